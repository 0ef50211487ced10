{{/*
Expand the name of the chart.
*/}}
{{- define "outbox-relay.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Create a default fully qualified app name.
If the release name contains the chart name it is used as the full name.
*/}}
{{- define "outbox-relay.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "outbox-relay.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "outbox-relay.labels" -}}
helm.sh/chart: {{ include "outbox-relay.chart" . }}
{{ include "outbox-relay.selectorLabels" . }}
{{- if .Chart.AppVersion }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "outbox-relay.selectorLabels" -}}
app.kubernetes.io/name: {{ include "outbox-relay.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "outbox-relay.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "outbox-relay.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The image: pulled by digest when image.digest is set (the tag is then ignored).
*/}}
{{- define "outbox-relay.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}
{{- end }}

{{/*
Whether `relay migrate` runs in the hook Job (else in each pod's init container).
*/}}
{{- define "outbox-relay.migrationJob" -}}
{{- if and .Values.migrations.enabled .Values.migrations.job.enabled }}true{{ end }}
{{- end }}

{{/*
The relay's config: values.relay.config, or the example in files/ when it is empty.
*/}}
{{- define "outbox-relay.config" -}}
{{- $config := .Values.relay.config }}
{{- if not $config }}
{{- $config = .Files.Get "files/relay.example.yaml" | fromYaml }}
{{- end }}
{{- toYaml $config }}
{{- end }}

{{/*
The http port the relay listens on (http.port, default 9464), after checking that the
probes and the scrape can reach it.
*/}}
{{- define "outbox-relay.httpPort" -}}
{{- $config := include "outbox-relay.config" . | fromYaml }}
{{- $http := $config.http | default dict }}
{{- if and (hasKey $http "enabled") (not $http.enabled) }}
{{- fail "relay.config: http.enabled is false, but the chart's probes (/healthz, /readyz) and /metrics need the relay's HTTP server: remove http.enabled or set it to true" }}
{{- end }}
{{- if has (toString ($http.host | default "0.0.0.0")) (list "127.0.0.1" "localhost" "::1") }}
{{- fail (printf "relay.config: http.host %s is a loopback address: the kubelet's probes and Prometheus cannot reach it; use 0.0.0.0 (the default)" $http.host) }}
{{- end }}
{{- $port := 9464 }}
{{- if hasKey $http "port" }}
{{- $port = $http.port | int }}
{{- end }}
{{- if or (lt $port 1) (gt $port 65535) }}
{{- fail (printf "relay.config: http.port %d must be a fixed port between 1 and 65535 (the probes need to know it)" $port) }}
{{- end }}
{{- $port }}
{{- end }}

{{/*
A relay duration (10, 10.5, "500ms", "10s", "2m", "1h") in seconds, as a float string.
Called with (list value "key.for.messages").
*/}}
{{- define "outbox-relay.seconds" -}}
{{- $value := index . 0 }}
{{- $key := index . 1 }}
{{- if kindIs "string" $value }}
{{- if not (regexMatch "^\\s*[0-9]+(\\.[0-9]+)?\\s*(us|ms|s|m|h)\\s*$" $value) }}
{{- fail (printf "%s: %q is not a duration; write it like 10s, 500ms or 1m" $key $value) }}
{{- end }}
{{- $number := regexFind "[0-9]+(\\.[0-9]+)?" $value | float64 }}
{{- $unit := regexFind "(us|ms|s|m|h)\\s*$" $value | trim }}
{{- $scale := get (dict "us" 0.000001 "ms" 0.001 "s" 1.0 "m" 60.0 "h" 3600.0) $unit }}
{{- mulf $number $scale }}
{{- else }}
{{- float64 $value }}
{{- end }}
{{- end }}

{{/*
The relay's shutdown.grace_period in seconds: RELAY_SHUTDOWN__GRACE_PERIOD in extraEnv beats
the file, as it does in the relay.
*/}}
{{- define "outbox-relay.gracePeriod" -}}
{{- $config := include "outbox-relay.config" . | fromYaml }}
{{- $grace := 10.0 }}
{{- $source := "shutdown.grace_period" }}
{{- with $config.shutdown }}
{{- if hasKey . "grace_period" }}
{{- $grace = .grace_period }}
{{- end }}
{{- end }}
{{- range .Values.extraEnv }}
{{- if and (eq .name "RELAY_SHUTDOWN__GRACE_PERIOD") (hasKey . "value") }}
{{- $grace = .value }}
{{- $source = "extraEnv RELAY_SHUTDOWN__GRACE_PERIOD" }}
{{- end }}
{{- end }}
{{- include "outbox-relay.seconds" (list $grace (printf "relay.config: %s" $source)) }}
{{- end }}

{{- define "outbox-relay.validateGrace" -}}
{{- $grace := include "outbox-relay.gracePeriod" . | float64 }}
{{- $termination := .Values.terminationGracePeriodSeconds | float64 }}
{{- if le $termination $grace }}
{{- fail (printf "terminationGracePeriodSeconds (%v) must be larger than the relay's shutdown.grace_period (%vs): the kubelet kills the pod when terminationGracePeriodSeconds runs out, and the relay needs its whole grace period to finish the in-flight batch, then a moment to release its leases. Raise terminationGracePeriodSeconds (e.g. to grace_period + 20) or lower shutdown.grace_period." $termination $grace) }}
{{- end }}
{{- end }}

{{/*
Environment variables the config needs: every ${VAR} without a :-default. `$$` is a literal
dollar and starts no reference. Returns a JSON list.
*/}}
{{- define "outbox-relay.configVars" -}}
{{- $vars := list }}
{{- range regexFindAll "\\$\\$|\\$\\{[A-Za-z_][A-Za-z0-9_]*\\}" (include "outbox-relay.config" .) -1 }}
{{- if ne . "$$" }}
{{- $vars = append $vars (trimSuffix "}" (trimPrefix "${" .)) }}
{{- end }}
{{- end }}
{{- $vars | uniq | sortAlpha | toJson }}
{{- end }}

{{- define "outbox-relay.secretName" -}}
{{- .Values.existingSecret | default (include "outbox-relay.fullname" .) }}
{{- end }}

{{- define "outbox-relay.usesSecret" -}}
{{- if or .Values.existingSecret .Values.secret.create }}true{{ end }}
{{- end }}

{{/*
Environment variables taken from the Secret, as a JSON object {VAR: key}: every key of
secret.values (or secretKeys with existingSecret) plus every ${VAR} of the config, except
those that extraEnv or the chart itself sets.
*/}}
{{- define "outbox-relay.secretEnv" -}}
{{- $taken := list "POD_NAME" "POD_NAMESPACE" "RELAY_CONFIG" }}
{{- range .Values.extraEnv }}
{{- $taken = append $taken .name }}
{{- end }}
{{- $needed := include "outbox-relay.configVars" . | fromJsonArray }}
{{- $result := dict }}
{{- if and .Values.existingSecret .Values.secret.values }}
{{- fail "secret.values is set, but existingSecret is used and the chart creates no Secret: put the values in the existing Secret, or unset existingSecret" }}
{{- end }}
{{- if and .Values.secretKeys (not .Values.existingSecret) }}
{{- fail "secretKeys maps variables to the keys of existingSecret, which is not set: set existingSecret, or use secret.values (its keys are the variable names)" }}
{{- end }}
{{- if .Values.existingSecret }}
{{- range $var, $key := .Values.secretKeys }}
{{- $_ := set $result $var $key }}
{{- end }}
{{- range $needed }}
{{- if not (hasKey $result .) }}
{{- $_ := set $result . . }}
{{- end }}
{{- end }}
{{- else if .Values.secret.create }}
{{- range $var, $_ := .Values.secret.values }}
{{- $_ := set $result $var $var }}
{{- end }}
{{- range $needed }}
{{- $_ := set $result . . }}
{{- end }}
{{- else }}
{{- $missing := list }}
{{- range $needed }}
{{- if not (has . $taken) }}
{{- $missing = append $missing . }}
{{- end }}
{{- end }}
{{- if and $missing (not .Values.extraEnvFrom) }}
{{- fail (printf "relay.config uses ${%s}, but nothing sets it: set secret.create=true with secret.values.%s, or existingSecret (with secretKeys), or add it to extraEnv or extraEnvFrom" (first $missing) (first $missing)) }}
{{- end }}
{{- end }}
{{- range $taken }}
{{- $_ := unset $result . }}
{{- end }}
{{- $result | toJson }}
{{- end }}

{{/*
The containers' environment. Called with (dict "ctx" $ "extra" LIST): entries of LIST come
last and replace the chart's variables of the same name. "secretName" overrides the Secret
the variables come from (the migration hook's copy).
*/}}
{{- define "outbox-relay.env" -}}
{{- $ctx := .ctx }}
{{- $extra := .extra | default list }}
{{- $replaced := list }}
{{- range $extra }}
{{- $replaced = append $replaced .name }}
{{- end }}
{{- if not (has "POD_NAME" $replaced) }}
# The relay's identity: relay:<pod>:<pid> in pg_stat_activity and relay status.
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
{{- end }}
{{- if not (has "POD_NAMESPACE" $replaced) }}
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
{{- end }}
- name: RELAY_CONFIG
  value: /etc/relay/relay.yaml
{{- $secretName := .secretName | default (include "outbox-relay.secretName" $ctx) }}
{{- range $var, $key := include "outbox-relay.secretEnv" $ctx | fromJson }}
{{- if not (has $var $replaced) }}
- name: {{ $var }}
  valueFrom:
    secretKeyRef:
      name: {{ $secretName }}
      key: {{ $key }}
{{- end }}
{{- end }}
{{- range $ctx.Values.extraEnv }}
{{- if not (has .name $replaced) }}
- {{ toYaml . | nindent 2 | trim }}
{{- end }}
{{- end }}
{{- range $extra }}
- {{ toYaml . | nindent 2 | trim }}
{{- end }}
{{- end }}

{{- define "outbox-relay.volumeMounts" -}}
- name: config
  mountPath: /etc/relay
  readOnly: true
- name: tmp
  mountPath: /tmp
{{- with .Values.volumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
The pods' volumes. Called with $, or with (dict "ctx" $ "configMap" NAME) for the
migration hook, whose config is a copy of its own.
*/}}
{{- define "outbox-relay.volumes" -}}
{{- $ctx := .ctx | default . }}
{{- $configMap := .configMap | default (include "outbox-relay.fullname" $ctx) -}}
- name: config
  configMap:
    name: {{ $configMap }}
- name: tmp
  emptyDir:
    {{- with $ctx.Values.tmpDir.sizeLimit }}
    sizeLimit: {{ . }}
    {{- end }}
{{- with $ctx.Values.volumes }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
Label matchers for this release's series in alert rules: (list $ "extra matchers").
*/}}
{{- define "outbox-relay.seriesSelector" -}}
{{- $ctx := index . 0 }}
{{- $extra := index . 1 }}
{{- $base := $ctx.Values.prometheusRule.seriesSelector | default (printf "namespace=%q,job=%q" $ctx.Release.Namespace (include "outbox-relay.fullname" $ctx)) }}
{{- printf "{%s}" (compact (list $base $extra) | join ",") }}
{{- end }}
