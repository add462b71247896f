"""Map a request's API key to its tenant; without configured keys every request is the default tenant."""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from starlette.requests import Request

from service.http.errors import ApiError
from service.settings import DEFAULT_TENANT, PodSettings


@dataclass(frozen=True)
class Tenant:
    name: str
    salt: bytes


def _presented_key(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return request.headers.get("x-api-key") or None


def resolve_tenant(request: Request, settings: PodSettings) -> Tenant:
    """The caller's tenant; 401 when keys are configured and none of them was presented."""
    if not settings.multi_tenant:
        return Tenant(DEFAULT_TENANT, settings.tenant_salt(DEFAULT_TENANT))
    presented = _presented_key(request)
    if presented is not None:
        for key, tenant in settings.api_keys.items():
            if hmac.compare_digest(key.encode(), presented.encode()):
                return Tenant(tenant, settings.tenant_salt(tenant))
    raise ApiError(401, "a valid API key is required (Authorization: Bearer KEY)", type_="authentication_error",
                   code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
