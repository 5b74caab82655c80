"""Check request parameters against botocore's ECS service model before sending or writing.

botocore's ``ParamValidator`` is what boto3 runs client-side before every call:
a rendered file that passes here has the exact shape boto3 (and the AWS CLI's
``--cli-input-json``) accept for the operation. It checks names, types, enums,
required members and lengths (not enum values, which botocore leaves to the service);
it cannot check what only ECS knows (that a role
exists, that a device path is present on the instance).
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
    if report.has_errors():
        raise SchemaError(f"{service} {operation}: {report.generate_report()}")
