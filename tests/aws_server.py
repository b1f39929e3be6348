"""The AWS API for tests: moto, running as a real HTTP server on 127.0.0.1, and what moto lacks.

    with AWSTestServer(cluster) as aws:           # cluster: a started NetnsCluster, or None
        os.environ.update(aws.environment())       # boto3 then talks to it (AWS_ENDPOINT_URL)
        make_job("demo", 2, provider="aws", zone=aws.zone, vpc_cidr=AWSTestServer.VPC_CIDR, ...)

boto3 talks HTTP to moto's own server application; this is the only emulated part of speedrun's
tests. Between the two sits a small WSGI layer doing five things, and only these:

1. The placement-group calls, which moto 5.2 does not implement (CreatePlacementGroup,
   DescribePlacementGroups, DeletePlacementGroup), emulated in memory: RunInstances naming an
   unknown group is refused, and a group in use cannot be deleted, as on AWS. moto also drops an
   instance's group, so the layer keeps it (`placement_of`).
2. Machines boot: after moto answers RunInstances or StartInstances, each instance whose private
   address lies in one of the cluster's subnets becomes a network-namespace host at exactly that address,
   its sshd admitting the instance's key pair (as cloud-init would install it), logging in as
   root. TerminateInstances and StopInstances take the host down. So SSH, tmux and training
   run for real on the addresses moto handed out.
3. Chosen calls are answered with AWS's error codes (`fail`), as AWS answers when capacity or a
   quota runs out; moto itself never runs out. Or (`garble`) with what no AWS endpoint sends but a
   proxy or load balancer on the way may: HTTP 502 with an HTML page that is not XML, which
   botocore cannot parse (ResponseParserError). The call then never reaches moto.
4. The Price List API's GetProducts, which moto does not implement (no `pricing` service at
   all): answered from the prices a test lists (`list_price`), in AWS's shape (PriceList: JSON
   texts of products whose terms.OnDemand...pricePerUnit.USD is the price), for the filters
   speedrun sends (instanceType, regionCode); nothing listed: an empty PriceList.
5. It notes each call's parameters as sent (`sent`), emulating nothing: moto keeps neither an
   interface's InterfaceType nor its NetworkCardIndex, so tests read EFA's layout in the request.

The VPC range for tests is 198.51.100.0/24 (TEST-NET-2): speedrun gives zone i of the region the
i-th /28 of it, which is network slot i of tests/netns.py, so the cluster's slot decides the zone
(`zone`). A cluster with a second subnet (NetnsCluster.add_subnet) boots instances of a second
zone too (`zones`), on the same bridge: the two zones' hosts reach each other as a VPC's subnets
do. Nothing here sends a packet beyond loopback and the namespace hosts.

Run it by hand (as root) for a shell session against it: `python tests/aws_server.py`.
"""
from __future__ import annotations

import contextlib
import io
import ipaddress
import itertools
import json
import logging
import re
import sys
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable
from urllib.parse import parse_qs
from xml.sax.saxutils import escape

sys.path.insert(0, str(Path(__file__).resolve().parent))
from netns import NetnsCluster, NetnsHost  # noqa: E402

REGION = "us-east-1"
ZONES = [f"{REGION}{c}" for c in "abcdef"]  # moto's zones of us-east-1, in name order
EC2_NS = "http://ec2.amazonaws.com/doc/2016-11-15/"


@dataclass
class Fault:
    action: str
    code: str | None  # None: the reply is not AWS's at all (`garble`)
    zone: str | None  # only calls placing instances in this zone; None: any
    market: str | None  # "spot" / "on-demand": only such launches; None: any
    times: int | None = None  # answer this many matching calls so, then none; None: every one


class AWSTestServer:
    """moto on 127.0.0.1 (a free port) with the layer described above; a context manager."""

    VPC_CIDR = "198.51.100.0/24"

    def __init__(self, cluster: NetnsCluster | None = None):
        self.cluster = cluster
        self.placement_groups: dict[str, dict[str, Any]] = {}
        self.faults: list[Fault] = []
        self.booted: dict[str, NetnsHost] = {}  # instance id -> its host
        self.placement_of: dict[str, str] = {}  # instance id -> its placement group, until terminated
        self.calls: list[str] = []  # every action asked for, in order
        self.requests: list[tuple[str, dict[str, str]]] = []  # and its parameters, as sent (query protocol)
        self.listed: dict[tuple[str, str], float] = {}  # (region, instance type) -> on-demand $/h (GetProducts)
        self._lock = threading.Lock()
        self._server = None
        self._thread: threading.Thread | None = None
        self._ids = itertools.count(1)

    # --- life cycle ---
    def __enter__(self) -> "AWSTestServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
        from werkzeug.serving import make_server
        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request otherwise
        self._moto = DomainDispatcherApplication(create_backend_app)
        self._server = make_server("127.0.0.1", 0, self, threaded=True)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._thread.join()
            self._server = None
        for host in list(self.booted.values()):
            self.cluster.remove_host(host)
        self.booted.clear()

    @property
    def endpoint(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def zone(self) -> str:
        """The zone whose subnet is the cluster's first network (instances there boot as hosts)."""
        return ZONES[self.cluster.slot]

    @property
    def zones(self) -> list[str]:
        """Every zone whose instances boot: one per network of the cluster (`zone` first)."""
        return [ZONES[slot] for slot in (self.cluster.slot, *self.cluster.extra_slots)]

    def environment(self) -> dict[str, str]:
        """Variables that point boto3 (and so speedrun) at this server, with made-up credentials."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_DEFAULT_REGION": REGION, "AWS_REGION": REGION}

    def client(self, service: str = "ec2"):
        import boto3
        return boto3.client(service, region_name=REGION, endpoint_url=self.endpoint, aws_access_key_id="testing",
                            aws_secret_access_key="testing")

    def fail(self, action: str, code: str, *, zone: str | None = None, market: str | None = None,
             times: int | None = None) -> None:
        """Answer `action` with the AWS error `code` from now on (where zone/market match): every
        time, or the next `times` times only (capacity that comes back)."""
        self.faults.append(Fault(action, code, zone, market, times))

    def garble(self, action: str) -> None:
        """Answer `action` from now on as a failing proxy in front of AWS would: HTTP 502 and an
        HTML page that is not XML (the call does not reach moto)."""
        self.faults.append(Fault(action, None, None, None))

    def list_price(self, instance_type: str, usd_per_hour: float, region: str = REGION) -> None:
        """Have the Price List API list `instance_type`'s on-demand Linux price in `region`."""
        self.listed[(region, instance_type)] = usd_per_hour

    def sent(self, action: str) -> list[dict[str, str]]:
        """The parameters of each `action` request speedrun sent, in order (e.g. RunInstances')."""
        return [params for name, params in self.requests if name == action]

    def reset(self) -> None:
        """Forget faults and everything moto holds (a new account); booted hosts go down."""
        self.faults.clear()
        self.listed.clear()
        self.placement_groups.clear()
        self.placement_of.clear()
        self.calls.clear()
        self.requests.clear()
        for host in list(self.booted.values()):
            self.cluster.remove_host(host)
        self.booted.clear()
        import urllib.request
        urllib.request.urlopen(urllib.request.Request(f"{self.endpoint}/moto-api/reset", method="POST")).read()

    # --- the WSGI layer ---
    def __call__(self, environ: dict[str, Any], start_response) -> Iterable[bytes]:
        body = environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
        environ["wsgi.input"] = io.BytesIO(body)
        params = {k: v[0] for k, v in parse_qs(body.decode("utf-8", errors="replace")).items()}
        # The JSON protocol's services (the Price List API) name the call in a header instead.
        action = params.get("Action", "") or environ.get("HTTP_X_AMZ_TARGET", "").rpartition(".")[2]
        if action:
            self.calls.append(action)
            self.requests.append((action, params))
        fault = next((f for f in self.faults if self._matches(f, action, params)), None)
        if fault is not None and fault.times is not None:
            fault.times -= 1
            if fault.times == 0:
                self.faults.remove(fault)
        if fault is not None and fault.code is None:
            # Not "<html>..." (botocore reads that as a bare HTTP error) and not XML either (<br>).
            start_response("502 Bad Gateway", [("Content-Type", "text/html")])
            return [b"<!DOCTYPE html><html><body><h1>502 Bad Gateway</h1><br>the proxy got no answer</body></html>"]
        if fault is not None:
            return self._error(start_response, fault.code, f"{fault.code} (injected by the test server)")
        if action in ("CreatePlacementGroup", "DescribePlacementGroups", "DeletePlacementGroup"):
            return self._placement_groups(action, params, start_response)
        if action == "GetProducts":
            return self._get_products(json.loads(body or b"{}"), start_response)
        if action == "RunInstances":
            group = params.get("Placement.GroupName")
            if group and group not in self.placement_groups:
                return self._error(start_response, "InvalidPlacementGroup.Unknown",
                                   f"The Placement Group '{group}' is unknown.")
        status, headers, out = self._forward(environ)
        if action in ("RunInstances", "StartInstances") and status.startswith("200"):
            ids = list(dict.fromkeys(re.findall(r"<instanceId>(i-[0-9a-f]+)</instanceId>", out.decode())))
            if params.get("Placement.GroupName"):  # moto drops it; AWS keeps it
                self.placement_of.update(dict.fromkeys(ids, params["Placement.GroupName"]))
            self._boot(ids)
        elif action in ("TerminateInstances", "StopInstances") and status.startswith("200"):
            for key, value in params.items():
                if key.startswith("InstanceId."):
                    if action == "TerminateInstances":
                        self.placement_of.pop(value, None)
                    if value in self.booted:
                        self.cluster.remove_host(self.booted.pop(value))
        start_response(status, headers)
        return [out]

    def _forward(self, environ: dict[str, Any]) -> tuple[str, list, bytes]:
        got: dict[str, Any] = {}

        def start(status, headers, exc_info=None):
            got["status"], got["headers"] = status, headers
        out = b"".join(self._moto(environ, start))
        return got["status"], got["headers"], out

    @staticmethod
    def _matches(f: Fault, action: str, params: dict[str, str]) -> bool:
        if f.action != action:
            return False
        if f.zone is not None and params.get("Placement.AvailabilityZone") != f.zone:
            return False
        spot = params.get("InstanceMarketOptions.MarketType") == "spot"
        return f.market is None or (f.market == "spot") == spot

    def _error(self, start_response, code: str, message: str) -> list[bytes]:
        start_response("400 Bad Request", [("Content-Type", "text/xml")])
        return [f'<?xml version="1.0" encoding="UTF-8"?><Response><Errors><Error><Code>{escape(code)}</Code>'
                f'<Message>{escape(message)}</Message></Error></Errors><RequestID>{uuid.uuid4()}</RequestID>'
                f'</Response>'.encode()]

    def _boot(self, ids: list[str]) -> None:
        """Bring up a namespace host for each instance in the cluster's subnet (see module doc)."""
        if self.cluster is None or not ids:
            return
        ec2 = self.client()
        subnets = [ipaddress.ip_network(n) for n in self.cluster.subnets]
        for r in ec2.describe_instances(InstanceIds=ids)["Reservations"]:
            for inst in r["Instances"]:
                address = inst.get("PrivateIpAddress")
                if not address or not any(ipaddress.ip_address(address) in n for n in subnets) or \
                        inst["InstanceId"] in self.booted:
                    continue
                key = ec2.describe_key_pairs(KeyNames=[inst["KeyName"]], IncludePublicKey=True)["KeyPairs"][0]
                with self._lock:
                    self.booted[inst["InstanceId"]] = self.cluster.add_host(address, key["PublicKey"])

    def _placement_groups(self, action: str, params: dict[str, str], start_response) -> list[bytes]:
        name = params.get("GroupName", "")
        if action == "CreatePlacementGroup":
            if name in self.placement_groups:
                return self._error(start_response, "InvalidPlacementGroup.Duplicate",
                                   f"The Placement Group '{name}' already exists.")
            tags = {params[k]: params.get(k[:-3] + "Value", "") for k in params
                    if re.fullmatch(r"TagSpecification\.1\.Tag\.\d+\.Key", k)}
            self.placement_groups[name] = {"name": name, "strategy": params.get("Strategy", "cluster"),
                                           "id": f"pg-{next(self._ids):017x}", "tags": tags}
            body = ("<return>true</return>"
                    f"<placementGroup>{self._group_xml(self.placement_groups[name])}</placementGroup>")
        elif action == "DeletePlacementGroup":
            if name not in self.placement_groups:
                return self._error(start_response, "InvalidPlacementGroup.Unknown",
                                   f"The Placement Group '{name}' is unknown.")
            if name in self.placement_of.values():
                return self._error(start_response, "InvalidPlacementGroup.InUse",
                                   f"The Placement Group '{name}' is in use.")
            del self.placement_groups[name]
            body = "<return>true</return>"
        else:
            groups = list(self.placement_groups.values())
            names = [v for k, v in params.items() if k.startswith("GroupName.")]
            if names:
                groups = [g for g in groups if g["name"] in names]
            for i in itertools.count(1):
                key = params.get(f"Filter.{i}.Name")
                if key is None:
                    break
                values = [v for k, v in params.items() if k.startswith(f"Filter.{i}.Value.")]
                if key == "group-name":
                    groups = [g for g in groups if g["name"] in values]
                elif key.startswith("tag:"):
                    groups = [g for g in groups if g["tags"].get(key[4:]) in values]
            body = "<placementGroupSet>" + "".join(f"<item>{self._group_xml(g)}</item>" for g in groups) + \
                "</placementGroupSet>"
        start_response("200 OK", [("Content-Type", "text/xml")])
        return [f'<?xml version="1.0" encoding="UTF-8"?><{action}Response xmlns="{EC2_NS}">'
                f'<requestId>{uuid.uuid4()}</requestId>{body}</{action}Response>'.encode()]

    def _get_products(self, request: dict[str, Any], start_response) -> list[bytes]:
        terms = {f["Field"]: f["Value"] for f in request.get("Filters", []) if f.get("Type") == "TERM_MATCH"}
        listed = [(region, itype, usd) for (region, itype), usd in self.listed.items()
                  if terms.get("instanceType", itype) == itype and terms.get("regionCode", region) == region]
        products = [json.dumps({
            "product": {"attributes": {"instanceType": itype, "regionCode": region, "operatingSystem": "Linux"}},
            "terms": {"OnDemand": {"T.JRTCKXETXF": {"priceDimensions": {"T.JRTCKXETXF.6YS6EN2CT7": {
                "unit": "Hrs", "pricePerUnit": {"USD": f"{usd:.10f}"}}}}}}}) for region, itype, usd in listed]
        start_response("200 OK", [("Content-Type", "application/x-amz-json-1.1")])
        return [json.dumps({"FormatVersion": "aws_v1", "PriceList": products}).encode()]

    @staticmethod
    def _group_xml(g: dict[str, Any]) -> str:
        tags = "".join(f"<item><key>{escape(k)}</key><value>{escape(v)}</value></item>" for k, v in g["tags"].items())
        return (f"<groupName>{escape(g['name'])}</groupName><strategy>{g['strategy']}</strategy>"
                f"<state>available</state><groupId>{g['id']}</groupId><tagSet>{tags}</tagSet>")


def main() -> None:
    """Serve until Ctrl-C, printing what a shell needs to use it."""
    import argparse
    import signal
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fail", action="append", default=[], metavar="ACTION:CODE[:ZONE[:MARKET]]",
                        help="answer ACTION with the AWS error CODE, e.g. RunInstances:VcpuLimitExceeded::on-demand")
    args = parser.parse_args()
    cluster = NetnsCluster(0, first_slot=0)
    cluster.start()
    with contextlib.ExitStack() as stack:
        stack.callback(cluster.stop)
        aws = stack.enter_context(AWSTestServer(cluster))
        for spec in args.fail:
            action, code, zone, market = (spec.split(":") + ["", ""])[:4]
            aws.fail(action, code, zone=zone or None, market=market or None)
        print("# the AWS test server (moto) and its namespace machines are up; in another shell:")
        for k, v in aws.environment().items():
            print(f"export {k}={v}")
        print(f"# launch with: --provider aws --zone {aws.zone} --vpc-cidr {AWSTestServer.VPC_CIDR} --private-ips "
              f"--ssh-user root --image 'ubuntu/images/hvm-ssd/ubuntu-*' --no-shared-storage", flush=True)
        signal.signal(signal.SIGTERM, lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
        with contextlib.suppress(KeyboardInterrupt):
            threading.Event().wait()


if __name__ == "__main__":
    main()
