"""Hiding secrets wherever a URL, a setting or an error text is shown or logged."""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit, urlunsplit

HIDDEN = "***"
# A setting whose value is a credential (HYATLAS_LLM_KEY, llm_key_file, token, ...): only
# whether it is set is ever shown.
_SECRET_SETTING = re.compile(r"(^|_)(KEY|TOKEN|SECRET|PASSWORD|PASSWD)(_FILE)?$", re.IGNORECASE)
# A query-string parameter whose value is a credential (api_key, access_token, sig, ...).
_SECRET_PARAM = re.compile(
    r"key|token|secret|passw|pwd|auth|credential|signature|^sig$|^code$", re.IGNORECASE
)
# A URL inside free text (an error message, a log line).
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+")


def redact_url(url: str) -> str:
    """url with the password of its userinfo and its secret query values replaced by ***.

    A userinfo with no password is hidden whole: a lone name before the host is often a token.
    """
    try:
        parts = urlsplit(url)
    except ValueError:
        return "(unparsable URL)"
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        user, has_password, _ = userinfo.partition(":")
        netloc = f"{user}:{HIDDEN}@{host}" if has_password else f"{HIDDEN}@{host}"
    query = "&".join(_redact_param(param) for param in parts.query.split("&"))
    return urlunsplit(parts._replace(netloc=netloc, query=query))


def _redact_param(param: str) -> str:
    name, has_value, _ = param.partition("=")
    return f"{name}={HIDDEN}" if has_value and _SECRET_PARAM.search(name) else param


def redact_text(text: str) -> str:
    """text with every URL in it redacted (see redact_url)."""
    if "://" not in text:
        return text
    return _URL_IN_TEXT.sub(lambda match: redact_url(match.group(0)), text)


def is_secret_setting(name: str) -> bool:
    """Whether a setting (by variable or field name) holds a credential."""
    return bool(_SECRET_SETTING.search(name))


def shown_setting(name: str, value: Any) -> Any:
    """A setting's value as it may be shown: "(set)"/"(not set)" for a credential, text with
    its URLs redacted, anything else as it is."""
    if is_secret_setting(name):
        return "(set)" if value else "(not set)"
    if isinstance(value, str):
        return redact_text(value)
    return value
