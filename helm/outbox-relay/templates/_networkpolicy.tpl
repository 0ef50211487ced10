{{/*
Helpers of templates/networkpolicy.yaml: the ports the relay connects to, read from its
config, and the egress rules built from them.
*/}}

{{/*
The TCP ports a list of addresses is reached at, as a JSON list of numbers. Called with
(dict "addresses" LIST "scheme" DEFAULT_SCHEME "key" "relay.config brokers.x.servers"
"setting" "networkPolicy.egress.brokers.x.ports"). An address is a URL or a bare host:port,
a comma-separated list of hosts (PostgreSQL), with `?port=` in the query (PostgreSQL).
A port that only the environment gives at start-up (`${VAR}`) fails the render, naming the
key and the value to set instead; the address itself is never printed (it may hold a
password).
*/}}
{{- define "outbox-relay.addressPorts" -}}
{{- $defaults := dict "postgresql" 5432 "postgres" 5432 "nats" 4222 "tls" 4222 "ws" 80 "wss" 443 "kafka" 9092 "amqp" 5672 "amqps" 5671 "http" 80 "https" 443 "redis" 6379 "rediss" 6379 }}
{{- $ctx := . }}
{{- $ports := list }}
{{- range $index, $address := .addresses }}
{{- $where := printf "%s[%d]" $ctx.key $index }}
{{- if eq (len $ctx.addresses) 1 }}
{{- $where = $ctx.key }}
{{- end }}
{{- $unknown := printf "networkPolicy.enabled: %s takes its port from the environment (${VAR}) when the relay starts, so the NetworkPolicy cannot be rendered with it: set %s, for example [{port: %v, protocol: TCP}]" $where $ctx.setting (get $defaults $ctx.scheme) }}
{{- $text := toString $address | trim }}
{{- $scheme := $ctx.scheme }}
{{- $rest := $text }}
{{- if regexMatch "^[A-Za-z][A-Za-z0-9+.-]*://" $text }}
{{- $scheme = regexFind "^[A-Za-z][A-Za-z0-9+.-]*" $text | lower }}
{{- $rest = regexReplaceAll "^[A-Za-z][A-Za-z0-9+.-]*://" $text "" }}
{{- end }}
{{- $default := get $defaults $scheme }}
{{- if not $default }}
{{- fail (printf "networkPolicy.enabled: %s: no default port is known for the scheme %s; set %s" $where $scheme $ctx.setting) }}
{{- end }}
{{- /* The hosts: before the first / ? or #, after the last @ (user and password go). */}}
{{- $authority := regexReplaceAll "[/?#].*$" $rest "" }}
{{- $hosts := regexReplaceAll "^.*@" $authority "" }}
{{- $queryPorts := list }}
{{- range regexFindAll "[?&]port=[^&#]*" $rest -1 }}
{{- range splitList "," (regexReplaceAll "^[?&]port=" . "") }}
{{- if not (regexMatch "^[0-9]+$" .) }}
{{- fail $unknown }}
{{- end }}
{{- $queryPorts = append $queryPorts (. | int) }}
{{- end }}
{{- end }}
{{- range splitList "," $hosts }}
{{- $host := trim . }}
{{- if regexMatch ":[0-9]+$" $host }}
{{- $ports = append $ports (regexFind "[0-9]+$" $host | int) }}
{{- else if contains "$" $host }}
{{- fail $unknown }}
{{- else if $queryPorts }}
{{- $ports = concat $ports $queryPorts }}
{{- else }}
{{- $ports = append $ports $default }}
{{- end }}
{{- end }}
{{- end }}
{{- range $ports }}
{{- if or (lt . 1) (gt . 65535) }}
{{- fail (printf "networkPolicy.enabled: %s names the port %d, which is not between 1 and 65535" $ctx.key .) }}
{{- end }}
{{- end }}
{{- $ports | uniq | toJson }}
{{- end }}

{{/*
NetworkPolicyPorts (TCP) for a JSON list of numbers.
*/}}
{{- define "outbox-relay.tcpPorts" -}}
{{- $result := list }}
{{- range . | fromJsonArray | uniq }}
{{- $result = append $result (dict "port" (. | int) "protocol" "TCP") }}
{{- end }}
{{- $result | toJson }}
{{- end }}

{{/*
An egress rule to `to` (any address when empty) on `ports`.
*/}}
{{- define "outbox-relay.egressRule" -}}
{{- $rule := dict "ports" .ports }}
{{- with .to }}
{{- $_ := set $rule "to" . }}
{{- end }}
{{- $rule | toJson }}
{{- end }}

{{/*
The database's ports: networkPolicy.egress.database.ports, else database.url of the relay's
config (or RELAY_DATABASE__URL in extraEnv, which beats it, as in the relay).
*/}}
{{- define "outbox-relay.databasePorts" -}}
{{- $settings := .Values.networkPolicy.egress.database }}
{{- if $settings.ports }}
{{- $settings.ports | toJson }}
{{- else }}
{{- $config := include "outbox-relay.config" . | fromYaml }}
{{- $url := $config.database.url }}
{{- $key := "relay.config database.url" }}
{{- range .Values.extraEnv }}
{{- if eq .name "RELAY_DATABASE__URL" }}
{{- $key = "extraEnv RELAY_DATABASE__URL" }}
{{- $url = .value | default "${RELAY_DATABASE__URL}" }}
{{- end }}
{{- end }}
{{- $found := include "outbox-relay.addressPorts" (dict "addresses" (list $url) "scheme" "postgresql" "key" $key "setting" "networkPolicy.egress.database.ports") }}
{{- include "outbox-relay.tcpPorts" $found }}
{{- end }}
{{- end }}

{{/*
A broker's ports: networkPolicy.egress.brokers.NAME.ports, else its addresses in the
relay's config. Called with (list $ NAME BROKER_CONFIG).
*/}}
{{- define "outbox-relay.brokerPorts" -}}
{{- $ctx := index . 0 }}
{{- $name := index . 1 }}
{{- $broker := index . 2 }}
{{- $settings := get $ctx.Values.networkPolicy.egress.brokers $name | default dict }}
{{- $setting := printf "networkPolicy.egress.brokers.%s.ports" $name }}
{{- $key := printf "relay.config brokers.%s" $name }}
{{- if $settings.ports }}
{{- $settings.ports | toJson }}
{{- else }}
{{- $found := "" }}
{{- if eq $broker.type "nats" }}
{{- $found = include "outbox-relay.addressPorts" (dict "addresses" $broker.servers "scheme" "nats" "key" (printf "%s.servers" $key) "setting" $setting) }}
{{- else if eq $broker.type "kafka" }}
{{- $servers := $broker.bootstrap_servers }}
{{- if kindIs "string" $servers }}
{{- $servers = splitList "," $servers | compact }}
{{- end }}
{{- $found = include "outbox-relay.addressPorts" (dict "addresses" $servers "scheme" "kafka" "key" (printf "%s.bootstrap_servers" $key) "setting" $setting) }}
{{- else if eq $broker.type "rabbitmq" }}
{{- $found = include "outbox-relay.addressPorts" (dict "addresses" (list $broker.url) "scheme" "amqp" "key" (printf "%s.url" $key) "setting" $setting) }}
{{- else if eq $broker.type "redis" }}
{{- $found = include "outbox-relay.addressPorts" (dict "addresses" (list $broker.url) "scheme" "redis" "key" (printf "%s.url" $key) "setting" $setting) }}
{{- else if has $broker.type (list "sqs" "sns" "kinesis") }}
{{- $endpoint := $broker.endpoint_url | default (printf "https://%s.%s.amazonaws.com" $broker.type $broker.region) }}
{{- $found = include "outbox-relay.addressPorts" (dict "addresses" (list $endpoint) "scheme" "https" "key" (printf "%s.endpoint_url" $key) "setting" $setting) }}
{{- else if eq $broker.type "pubsub" }}
{{- $endpoint := $broker.emulator_host | default ($broker.endpoint | default "pubsub.googleapis.com:443") }}
{{- $found = include "outbox-relay.addressPorts" (dict "addresses" (list $endpoint) "scheme" "https" "key" (printf "%s.endpoint" $key) "setting" $setting) }}
{{- else if eq $broker.type "http" }}
{{- $url := $broker.url | default "{destination}" | toString }}
{{- if hasPrefix "{" $url }}
{{- fail (printf "networkPolicy.enabled: %s.url starts with {destination}, so each message names its own host; set %s, for example [{port: 443, protocol: TCP}]" $key $setting) }}
{{- end }}
{{- $found = include "outbox-relay.addressPorts" (dict "addresses" (list $url) "scheme" "https" "key" (printf "%s.url" $key) "setting" $setting) }}
{{- else }}
{{- fail (printf "networkPolicy.enabled: %s has the type %v, whose ports the chart does not know; set %s" $key $broker.type $setting) }}
{{- end }}
{{- include "outbox-relay.tcpPorts" $found }}
{{- end }}
{{- end }}

{{/*
The relay's egress rules, as a JSON list: DNS, the database, each broker of the config.
With "brokers" false (the migration), DNS and the database only.
*/}}
{{- define "outbox-relay.egressRules" -}}
{{- $ctx := .ctx }}
{{- $egress := $ctx.Values.networkPolicy.egress }}
{{- $rules := list }}
{{- if $egress.dns.enabled }}
{{- $dnsPorts := list (dict "port" 53 "protocol" "UDP") (dict "port" 53 "protocol" "TCP") }}
{{- $rules = append $rules (include "outbox-relay.egressRule" (dict "to" $egress.dns.to "ports" $dnsPorts) | fromJson) }}
{{- end }}
{{- $database := include "outbox-relay.databasePorts" $ctx | fromJsonArray }}
{{- $rules = append $rules (include "outbox-relay.egressRule" (dict "to" $egress.database.to "ports" $database) | fromJson) }}
{{- if .brokers }}
{{- $config := include "outbox-relay.config" $ctx | fromYaml }}
{{- $brokers := $config.brokers | default dict }}
{{- range $name, $_ := $egress.brokers }}
{{- if not (hasKey $brokers $name) }}
{{- fail (printf "networkPolicy.egress.brokers.%s: relay.config has no broker %s (its brokers: %s)" $name $name (keys $brokers | sortAlpha | join ", ")) }}
{{- end }}
{{- end }}
{{- range $name := keys $brokers | sortAlpha }}
{{- $ports := include "outbox-relay.brokerPorts" (list $ctx $name (get $brokers $name)) | fromJsonArray }}
{{- $settings := get $egress.brokers $name | default dict }}
{{- $rules = append $rules (include "outbox-relay.egressRule" (dict "to" $settings.to "ports" $ports) | fromJson) }}
{{- end }}
{{- end }}
{{- $rules | toJson }}
{{- end }}
