"""Check request parameters against botocore's ECS service model before sending or writing.

botocore's ``ParamValidator`` is what boto3 runs client-side before every call:
a rendered file that passes here has the exact shape boto3 (and the AWS CLI's
``--cli-input-json``) accept for the operation. It checks member names, types,
required members and lengths/ranges; enum values (which botocore leaves to the
service) are checked here against the same model. Not checked: what only ECS knows (that a role exists, that a device path is
present on the instance).
"""

from __future__ import annotations

from functools import cache
from typing import Any


class SchemaError(ValueError):
    """Parameters that botocore's ECS model rejects."""


@cache
def _model(service: str):
    import botocore.session

    return botocore.session.get_session().get_service_model(service)


def validate(operation: str, params: dict[str, Any], service: str = "ecs") -> None:
    from botocore.validate import ParamValidator

    shape = _model(service).operation_model(operation).input_shape
    report = ParamValidator().validate(params, shape)
    problems = [report.generate_report()] if report.has_errors() else []
    problems += _enum_problems(params, shape, "")
    if problems:
        raise SchemaError(f"{service} {operation}: " + "\n".join(problems))


def _enum_problems(value: Any, shape: Any, path: str) -> list[str]:
    """Values outside a string shape's enum, anywhere in the parameters."""
    kind = shape.type_name
    if kind == "structure" and isinstance(value, dict):
        return [
            p
            for key, v in value.items()
            if key in shape.members
            for p in _enum_problems(v, shape.members[key], f"{path}.{key}" if path else key)
        ]
    if kind == "list" and isinstance(value, list):
        return [
            p for i, v in enumerate(value) for p in _enum_problems(v, shape.member, f"{path}[{i}]")
        ]
    if kind == "map" and isinstance(value, dict):
        return [p for k, v in value.items() for p in _enum_problems(v, shape.value, f"{path}.{k}")]
    enum = getattr(shape, "enum", None)
    if kind == "string" and enum and isinstance(value, str) and value not in enum:
        return [f"Invalid value for parameter {path}, value: {value!r}, valid values: {enum}"]
    return []
