"""Registry credentials as E2B's build request carries them (`fromImageRegistry`), turned into a registry login.

    {type: "registry", username, password}                        → that login (Basic, or for a token service)
    {type: "gcp", serviceAccountJson}                             → `_json_key` / the JSON (how GCR and Artifact
                                                                     Registry take a service account)
    {type: "aws", awsAccessKeyId, awsSecretAccessKey, awsRegion}  → ECR's GetAuthorizationToken, `AWS` / token

The AWS call goes to `$KEEPSTATE_ECR_ENDPOINT` when set (a test's loopback endpoint), else to the region's ECR.
"""

from __future__ import annotations

import base64
import json
import os

from keepstate.errors import BadRequest

from .errors import RegistryAuthFailed, RegistryUnavailable
from .registry import Credentials

ECR_ENDPOINT_ENV = "KEEPSTATE_ECR_ENDPOINT"


def _field(cfg: dict[str, object], key: str) -> str:
    v = cfg.get(key)
    if not isinstance(v, str) or not v:
        raise BadRequest(f"fromImageRegistry.{key} must be a non-empty string for type `{cfg.get('type')}`")
    return v


def from_wire(cfg: object) -> Credentials | None:
    if cfg is None:
        return None
    if not isinstance(cfg, dict):
        raise BadRequest("fromImageRegistry must be an object with a `type`: registry, aws or gcp")
    kind = cfg.get("type")
    if kind == "registry":
        return Credentials(_field(cfg, "username"), _field(cfg, "password"))
    if kind == "gcp":
        key = _field(cfg, "serviceAccountJson")
        try:
            json.loads(key)
        except ValueError as e:
            raise BadRequest(f"fromImageRegistry.serviceAccountJson is not JSON: {e}") from e
        return Credentials("_json_key", key)
    if kind == "aws":
        return ecr_login(_field(cfg, "awsAccessKeyId"), _field(cfg, "awsSecretAccessKey"), _field(cfg, "awsRegion"))
    raise BadRequest(f"fromImageRegistry.type must be registry, aws or gcp, not {kind!r}")


def ecr_login(key_id: str, secret: str, region: str) -> Credentials:
    """ECR takes no access key at the registry: trade it for a 12-hour token first."""
    import boto3
    import botocore.exceptions

    client = boto3.client("ecr", region_name=region, aws_access_key_id=key_id, aws_secret_access_key=secret,
                          endpoint_url=os.environ.get(ECR_ENDPOINT_ENV) or None)
    try:
        data = client.get_authorization_token()["authorizationData"]
    except botocore.exceptions.ClientError as e:
        raise RegistryAuthFailed(f"AWS ECR refused the access key {key_id}: "
                                 f"{e.response.get('Error', {}).get('Message', e)}") from e
    except botocore.exceptions.BotoCoreError as e:
        raise RegistryUnavailable(f"AWS ECR in {region} is unreachable: {e}") from e
    if not data:
        raise RegistryAuthFailed(f"AWS ECR gave no authorization token for access key {key_id}")
    user, _, password = base64.b64decode(data[0]["authorizationToken"]).decode().partition(":")
    return Credentials(user, password)
