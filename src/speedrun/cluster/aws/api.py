"""Talking to AWS: boto3 (an optional dependency), a region's clients (`Session`), and every
botocore failure as one line.

`aws_errors(what)` is the one place where botocore's exceptions become messages. Each names the
API call that failed (DescribeInstances...) and what speedrun was doing, and says whose the
failure is:

- the user's (no or refused credentials, no permission, an unknown profile, a value AWS rejects):
  SpeedrunError, exit status 2;
- AWS's or the network's (no connection, a timeout, a 5xx or throttling answer, a reply that is
  not AWS's at all, such as a proxy's HTML error page, a waiter giving up): AWSFailed, exit
  status 3. Trying again later may work.
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Callable, Iterator

from speedrun.errors import EXIT_FAILED, SpeedrunError

CREDENTIAL_ERRORS = ("AuthFailure", "UnrecognizedClientException", "InvalidClientTokenId", "SignatureDoesNotMatch",
                     "ExpiredToken", "RequestExpired")
# Error codes with which AWS says that it, not the request, failed (AWS sends most of them with a
# 5xx status, which counts the same; throttling is AWS asking to come back later).
SERVER_ERRORS = ("InternalError", "InternalFailure", "InternalServerError", "ServiceUnavailable", "Unavailable",
                 "RequestLimitExceeded", "Throttling", "ThrottlingException", "RequestTimeout",
                 "RequestTimeoutException")
NO_CREDENTIALS = ("no AWS credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), "
                  "or run `aws configure`")


class AWSFailed(SpeedrunError):
    """AWS, or the way to it, failed; not the user's input or credentials. One line; the CLI exits
    with `exit_code` (3) instead of SpeedrunError's 2."""

    exit_code = EXIT_FAILED


def boto3_module():
    """boto3, or a SpeedrunError saying how to install it (it is an optional dependency)."""
    try:
        import boto3
    except ImportError:
        raise SpeedrunError("the AWS provider needs boto3: pip install 'speedrun[aws]'") from None
    return boto3


# The API call each thread made last and the HTTP status of its reply: botocore's parse errors and
# connection errors do not say which call they come from.
_last = threading.local()


def track_calls(client: Any) -> Any:
    """Have `client` note each call it makes (for aws_errors' messages); returns the client."""
    def before_call(model: Any, **_: Any) -> None:
        _last.call, _last.status = model.name, None

    def before_parse(operation_model: Any, response_dict: dict[str, Any], **_: Any) -> None:
        _last.call, _last.status = operation_model.name, response_dict.get("status_code")
    client.meta.events.register("before-call", before_call)
    client.meta.events.register("before-parse", before_parse)
    return client


def error_code(e: Exception) -> str:
    """The AWS error code of a botocore ClientError ("" for anything else)."""
    return (getattr(e, "response", None) or {}).get("Error", {}).get("Code", "")


def first_line(e: BaseException, limit: int = 200) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return (lines[0] if lines else type(e).__name__)[:limit]


@contextlib.contextmanager
def aws_errors(what: str) -> Iterator[None]:
    """Turn botocore's exceptions into one-line errors about `what` was being done, naming the call:
    SpeedrunError where the user can fix it, AWSFailed where AWS or the network failed."""
    from botocore.exceptions import (BotoCoreError, ClientError, ConnectionError, HTTPClientError,
                                     IncompleteReadError, NoCredentialsError, PartialCredentialsError, WaiterError)
    from botocore.parsers import ResponseParserError  # not a BotoCoreError
    try:
        yield
    except (NoCredentialsError, PartialCredentialsError):
        raise SpeedrunError(NO_CREDENTIALS) from None
    except ClientError as e:
        call, code = e.operation_name, error_code(e)
        message = first_line(Exception(e.response.get("Error", {}).get("Message", "")))
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        if code in CREDENTIAL_ERRORS:
            raise SpeedrunError(f"AWS refused the credentials ({call}: {code}) to {what}: check them with "
                                f"`aws sts get-caller-identity`") from None
        if code == "UnauthorizedOperation":
            raise SpeedrunError(f"your AWS credentials are not allowed to {what} ({call}: UnauthorizedOperation)") \
                from None
        if status >= 500 or code in SERVER_ERRORS:
            raise AWSFailed(f"AWS failed to {what} ({call}: {code}: {message}); try again later") from None
        raise SpeedrunError(f"cannot {what} ({call}: {code}: {message})") from None
    except ResponseParserError:
        status = f"HTTP {_last.status}" if getattr(_last, "status", None) else "a reply"
        raise AWSFailed(f"the reply to {call_name()} (to {what}) did not come from AWS ({status}, not XML): something "
                        f"between here and AWS failed; try again later") from None
    except WaiterError as e:
        error = (e.last_response or {}).get("Error", {})
        reason = error.get("Message") or first_line(e)
        if error.get("Code") in (*CREDENTIAL_ERRORS, "UnauthorizedOperation"):
            raise SpeedrunError(f"AWS refused to {what} ({call_name()}: {error['Code']}): {reason}") from None
        raise AWSFailed(f"gave up waiting to {what} ({call_name()}): {reason}") from None
    except (ConnectionError, HTTPClientError, IncompleteReadError) as e:
        raise AWSFailed(f"cannot reach AWS to {what} ({call_name()}): {first_line(e)}") from None
    except BotoCoreError as e:  # the configuration (a profile, a region) or a value: the user's
        raise SpeedrunError(f"cannot {what}: {first_line(e)}") from None


def call_name() -> str:
    """The API call this thread made last, for a message."""
    return getattr(_last, "call", None) or "the AWS API"


# --- a region's clients, and waiting where AWS has no waiter ---
class Session:
    """The EC2 and EFS clients of one region (and its zones, which every launch needs), and the
    Price List API's."""

    def __init__(self, region: str | None):
        boto3 = boto3_module()
        from botocore.config import Config
        with aws_errors("read the AWS configuration"):  # an unknown AWS_PROFILE, a bad region...
            session = boto3.Session()
            self.region = region or session.region_name or "us-east-1"
            if session.get_credentials() is None:
                raise SpeedrunError(NO_CREDENTIALS)
            config = Config(retries={"mode": "standard", "max_attempts": 4})
            self.ec2 = track_calls(session.client("ec2", region_name=self.region, config=config))
            self.efs = track_calls(session.client("efs", region_name=self.region, config=config))
        self._session = session
        self._pricing = None
        self.prices: dict[tuple[str, str], Any] = {}  # what pricing.listed_price found, by (market, type)
        self.networks: dict[str, Any] = {}  # what efa.type_network found, by instance type

    def pricing(self) -> Any:
        """The Price List API's client. Its endpoints are in a few regions only (us-east-1 serves
        every region's prices); asked briefly, once, as it is only a better price than the table."""
        if self._pricing is None:
            from botocore.config import Config
            config = Config(connect_timeout=3, read_timeout=5, retries={"mode": "standard", "max_attempts": 1})
            self._pricing = track_calls(self._session.client("pricing", region_name="us-east-1", config=config))
        return self._pricing

    def zones(self) -> list[str]:
        """The region's availability zones, in name order (which fixes each one's subnet range)."""
        with aws_errors(f"list the zones of {self.region}"):
            zones = self.ec2.describe_availability_zones(
                Filters=[{"Name": "zone-type", "Values": ["availability-zone"]}])["AvailabilityZones"]
        return sorted(z["ZoneName"] for z in zones)


def wait_until(ready: Callable[[], bool], timeout: float, what: str, every: float = 3.0) -> None:
    """Poll `ready` until it holds (AWS has no waiter for this), at most timeout seconds."""
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:  # AWS did not get there: not the user's doing
            raise AWSFailed(f"gave up after {timeout:g} s waiting for {what}")
        time.sleep(every)
