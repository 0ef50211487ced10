"""JSON Schemas of integration events: loaded and checked at start-up, compiled once.

Draft 4, 6 and 7 schemas (and those that name no `$schema`: draft 7) run as code that
fastjsonschema generates, about 25 times cheaper per message than jsonschema's
interpreter; fastjsonschema does not know drafts 2019-09 and 2020-12, so those run on
jsonschema's validator (see docs/performance.md). Either way the violations are
worded by jsonschema, which lists every one with its JSON path; that only runs for an
invalid message. `format` is an annotation, as the drafts say by default: not checked.
`multipleOf` is exact in decimal on both (0.3 is a multiple of 0.1), as fastjsonschema and
`relay contract diff` take it; jsonschema's own divides floats and refuses 0.3, so the relay
registers each draft's validator with an exact one, for every schema jsonschema reads.

Both libraries are imported only when a rule has a schema: jsonschema alone takes a fifth
of a second and 4 MiB to import, which a relay without schemas should not pay.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from fractions import Fraction
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ruamel.yaml import YAML
from ruamel.yaml.error import YAMLError

if TYPE_CHECKING:
    from jsonschema.protocols import Validator

_FAST_DRAFTS = ("draft-04", "draft-06", "draft-07")


class SchemaError(ValueError):
    """A schema that cannot be read, or is not a valid JSON Schema."""


def load_schema(value: str | dict[str, Any]) -> dict[str, Any]:
    """The schema document, read from its file when `value` is a path, and checked."""
    document = _read(Path(value)) if isinstance(value, str) else value
    where = f"schema file {value}" if isinstance(value, str) else "schema"
    if not isinstance(document, dict):
        raise SchemaError(f"{where}: a JSON Schema must be an object")
    if remote := _remote_refs(document):
        raise SchemaError(
            f"{where}: $ref {remote[0]!r} points outside the schema; the relay resolves only"
            " references within it (#/...): copy the referenced part under $defs"
        )
    from jsonschema.exceptions import SchemaError as MetaschemaError  # noqa: PLC0415 - see above

    try:
        validator_class(document).check_schema(document)
    except MetaschemaError as exc:
        at = exc.json_path if hasattr(exc, "json_path") else "$"
        raise SchemaError(f"{where} is not a valid JSON Schema: {exc.message} (at {at})") from None
    return document


def _remote_refs(node: Any) -> list[str]:
    """`$ref`s to other documents: resolving them would fetch files or URLs at start-up."""
    if isinstance(node, dict):
        ref = node.get("$ref")
        own = [ref] if isinstance(ref, str) and not ref.startswith("#") else []
        return own + [r for value in node.values() for r in _remote_refs(value)]
    if isinstance(node, list):
        return [r for value in node for r in _remote_refs(value)]
    return []


def _read(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SchemaError(f"cannot read schema file {path}: {exc.strerror or exc}") from None
    try:
        if path.suffix in (".yaml", ".yml"):
            return YAML(typ="safe", pure=True).load(text)
        return json.loads(text)
    except (ValueError, YAMLError) as exc:
        raise SchemaError(f"schema file {path} is not valid JSON or YAML: {exc}") from None


def validator_class(document: Any) -> type[Validator]:
    """jsonschema's validator of the draft the schema names (draft 7 when it names none),
    with an exact `multipleOf`."""
    from jsonschema.validators import validator_for  # noqa: PLC0415 - see the module's docstring

    found: type[Validator] = validator_for(document, default=_exact_validators()["draft7"])
    return found


@cache
def _exact_validators() -> dict[str, type[Validator]]:
    """Each draft's validator with an exact `multipleOf`, registered for its `$schema`: a
    `$ref` into a schema that names its draft (`#`, the root) takes the registered one."""
    from jsonschema import validators  # noqa: PLC0415 - see the module's docstring

    found: dict[str, type[Validator]] = {}
    for version, base in (
        ("draft4", validators.Draft4Validator),
        ("draft6", validators.Draft6Validator),
        ("draft7", validators.Draft7Validator),
        ("draft2019-09", validators.Draft201909Validator),
        ("draft2020-12", validators.Draft202012Validator),
    ):
        exact = validators.extend(base, {"multipleOf": _multiple_of})
        found[version] = validators.validates(version)(exact)
    return found


def _multiple_of(validator: Validator, step: Any, instance: Any, _schema: Any) -> Iterator[Any]:
    from jsonschema.exceptions import ValidationError  # noqa: PLC0415

    if validator.is_type(instance, "number") and not _is_multiple(instance, step):
        yield ValidationError(f"{instance!r} is not a multiple of {step}")


def _is_multiple(value: Any, step: Any) -> bool:
    """`value` is `step` times an integer, in decimal: each as its shortest repr (the JSON
    text's number), so 0.3 is a multiple of 0.1 although 0.3 / 0.1 is not 3 in floats."""
    try:
        return Fraction(repr(value)) % Fraction(repr(step)) == 0
    except (ValueError, OverflowError, ZeroDivisionError):  # inf, nan; a step of 0 is refused
        return False


@dataclass(frozen=True, slots=True)
class CompiledSchema:
    """One rule's schema, ready for every message: `is_valid` is the per-message check."""

    id: str | None  # `$id`, sent as the CloudEvents `dataschema`
    is_valid: Callable[[Any], bool]
    full: Validator  # words the violations of an invalid body

    def violations(self, value: Any) -> list[str]:
        """Each violation, as `$.path: message`, in the order of the document."""
        errors = sorted(self.full.iter_errors(value), key=lambda e: list(map(str, e.path)))
        return [f"{e.json_path}: {e.message}" for e in errors] or [
            "$: does not match the schema"  # the fast check and jsonschema disagree
        ]


def compile_schema(value: str | dict[str, Any]) -> CompiledSchema:
    document = load_schema(value)
    full = validator_class(document)(document)
    schema_uri = str(document.get("$schema", ""))
    if not schema_uri or any(draft in schema_uri for draft in _FAST_DRAFTS):
        is_valid = _fast(document)
    else:
        is_valid = full.is_valid
    id_ = document.get("$id")
    return CompiledSchema(id_ if isinstance(id_, str) else None, is_valid, full)


def _fast(document: dict[str, Any]) -> Callable[[Any], bool]:
    """fastjsonschema's generated check, as draft 7 unless `$schema` says 4 or 6.

    use_default=False: it would otherwise write the schema's defaults into the body.
    """
    import fastjsonschema  # noqa: PLC0415 - see the module's docstring

    try:
        check = fastjsonschema.compile(document, use_default=False, use_formats=False)
    except fastjsonschema.JsonSchemaDefinitionException as exc:
        raise SchemaError(f"schema cannot be compiled: {exc}") from None
    invalid = fastjsonschema.JsonSchemaValueException

    def is_valid(value: Any) -> bool:
        try:
            check(value)
        except invalid:
            return False
        return True

    return is_valid
