"""The steps of deploy/compose_check.sh against the containerised stack (docker-compose.yml with
deploy/docker-compose.hostnet.yml: every container on the host network, on 127.0.0.1).

1. `up -d`; time until the first authenticated answer; requests without the generated API key
   get 401.
2. Greedy chat completions over REST (plain and streamed) and gRPC, compared token for token
   with the embedded engine (deploy/compose_reference.py, run in the same image on the same
   prepared model), prompt token ids included. A seeded T = 1 request gives the same tokens
   every time: over REST twice, streamed beside a long request, over gRPC.
3. The drafter container is killed while a stream runs: the stream completes with the same
   output; the drafter is started again and the stack is healthy again.
4. The scheduler container is restarted while one request is finished and another is streaming:
   `GET /v1/requests/{id}` (and gRPC GetRequest) return what was produced, and resume completes
   both to the reference output.
5. `down` leaves no container of the project; `up -d` again reuses the prepared model (same
   volume, model file untouched) and answers exactly; the seeded request repeats its tokens.
With --monitoring-service (the monitoring profile's services whose images are here), those are
started too; Prometheus must scrape the scheduler and answer every PromQL expression of the
Grafana dashboard (deploy/grafana/dspark.json), its request counter holding the exactness
step's traffic.

Every step prints a line; the measurements go to a JSON report (--report). Exit code 0 only when
every step held. Needs the repository's Python environment (grpcio, the generated stubs).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import yaml

# Run by path: the checkout goes on sys.path before dspark can be imported, hence its own path.
if (_checkout := str(Path(__file__).resolve().parents[1])) not in sys.path:
    sys.path.insert(0, _checkout)

from dspark.paths import REPO_ROOT  # noqa: E402
from dspark.serving.grpc_runtime import channel  # noqa: E402
from dspark.serving.protos import pb, rpc  # noqa: E402

HOST = "127.0.0.1"
MODEL = "dspark"
# Short answers for the exactness comparison; long ones for the fault steps, so that the fault
# lands while tokens are still coming.
SHORT_CASES = [
    {"messages": [{"role": "user", "content": "Name three prime numbers."}], "max_tokens": 40},
    {"messages": [{"role": "system", "content": "You are a concise assistant."},
                  {"role": "user", "content": "What is the capital of France?"}],
     "max_tokens": 32},
    {"messages": [{"role": "user", "content": "Write a haiku about the sea."}], "max_tokens": 48},
]
LONG_CASES = [
    {"messages": [{"role": "user", "content": "Write a long, detailed story about a lighthouse "
                                              "keeper, with many paragraphs."}],
     "max_tokens": 128},
    {"messages": [{"role": "user", "content": "Explain in detail, step by step, how a computer "
                                              "boots, in many paragraphs."}],
     "max_tokens": 128},
]
# A seeded T = 1 request: it must give the same tokens every time it is sent to the stack, alone,
# beside another request, over REST and gRPC, and after `down` / `up` (docs/seeded_sampling.md).
SEEDED_CASE = {"messages": [{"role": "user", "content": "Write a haiku about the sea."}],
               "max_tokens": 32, "temperature": 1.0, "seed": 1234}
READY_TIMEOUT_SECONDS = 600.0
PROMETHEUS_PORT = 19090  # deploy/docker-compose.hostnet.yml
PROMETHEUS_TIMEOUT_SECONDS = 60.0
DASHBOARD = REPO_ROOT / "deploy" / "grafana" / "dspark.json"


class CheckFailed(AssertionError):
    pass


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise CheckFailed(message)


def log(message: str) -> None:
    print(f"compose check: {message}", flush=True)


@dataclass
class Compose:
    """docker-compose for one project with its files, and the names Docker gives its parts;
    `monitoring` names the monitoring profile's services to start with the stack."""

    project: str
    files: list[str]
    monitoring: list[str] = field(default_factory=list)

    def run(self, *args: str, check: bool = True, timeout: float = 900) -> str:
        command = ["docker-compose", "-p", self.project]
        for f in self.files:
            command += ["-f", f]
        if self.monitoring:
            command += ["--profile", "monitoring"]
        done = subprocess.run([*command, *args], cwd=REPO_ROOT, capture_output=True, text=True,
                              timeout=timeout)
        if check and done.returncode != 0:
            raise CheckFailed(f"{' '.join(args)} failed ({done.returncode}):\n"
                              f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
        return done.stdout + done.stderr

    def services_to_start(self) -> list[str]:
        """Every service outside a profile plus the chosen monitoring ones (none named: all of
        the active profiles' services, which `up` starts by default)."""
        if not self.monitoring:
            return []
        services = yaml.safe_load(self.run("config"))["services"]
        return [name for name, s in services.items() if not s.get("profiles")] + self.monitoring

    def container(self, service: str) -> str:
        return f"{self.project}_{service}_1"

    def volume(self, name: str) -> str:
        return f"{self.project}_{name}"

    def running_containers(self) -> list[str]:
        out = docker("ps", "-q", "--filter", f"label=com.docker.compose.project={self.project}")
        return out.split()


def docker(*args: str, timeout: float = 300, stdin: str | None = None) -> str:
    done = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout,
                          input=stdin)
    if done.returncode != 0:
        raise CheckFailed(f"docker {' '.join(args[:3])} failed: {done.stderr[-2000:]}")
    return done.stdout


def health_status(container: str) -> str:
    return docker("inspect", "-f", "{{if .State.Health}}{{.State.Health.Status}}{{else}}none"
                  "{{end}} {{.State.Status}}", container).strip()


def wait_healthy(container: str, timeout: float = READY_TIMEOUT_SECONDS) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if health_status(container).startswith("healthy"):
            return
        time.sleep(1.0)
    log_tail = subprocess.run(["docker", "logs", "--tail", "40", container], capture_output=True,
                              text=True).stdout
    raise CheckFailed(f"{container} not healthy after {timeout:.0f} s "
                      f"({health_status(container)}):\n{log_tail}")


# -- REST and gRPC clients ----------------------------------------------------------------------

@dataclass
class Client:
    http_port: int
    grpc_port: int
    api_key: str

    def _request(self, method: str, path: str, body: dict | None = None,
                 key: str | None = None, timeout: float = 300) -> urllib.request.Request:
        headers = {"Content-Type": "application/json"}
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        data = json.dumps(body).encode() if body is not None else None
        return urllib.request.Request(f"http://{HOST}:{self.http_port}{path}", data=data,
                                      headers=headers, method=method)

    def call(self, method: str, path: str, body: dict | None = None, key: str | None = "",
             timeout: float = 300) -> tuple[int, dict]:
        """(status, JSON body); key "" = this client's key, None = no Authorization header."""
        request = self._request(method, path, body, self.api_key if key == "" else key)
        try:
            with urllib.request.urlopen(request, timeout=timeout) as reply:
                return reply.status, json.loads(reply.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    def chat(self, case: dict) -> dict:
        status, body = self.call("POST", "/v1/chat/completions",
                                 {"model": MODEL, "temperature": 0, **case})
        expect(status == 200, f"chat completion answered {status}: {body}")
        return body

    def stream_chat(self, case: dict, on_chunk=None) -> tuple[str, list[int], str | None]:
        """Streams a chat completion over SSE: (request id, token ids, finish reason).
        on_chunk(tokens so far) is called after every chunk."""
        request = self._request("POST", "/v1/chat/completions",
                                {"model": MODEL, "temperature": 0, "stream": True, **case},
                                self.api_key)
        tokens: list[int] = []
        request_id, finish = "", None
        with urllib.request.urlopen(request, timeout=300) as reply:
            for raw in reply:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                request_id = chunk.get("id", request_id)
                tokens += (chunk.get("dspark") or {}).get("token_ids", [])
                for choice in chunk.get("choices", []):
                    finish = choice.get("finish_reason") or finish
                if on_chunk is not None:
                    on_chunk(tokens)
        return request_id, tokens, finish

    def grpc_generate(self, case: dict) -> tuple[str, list[int]]:
        stub = rpc.generation.GenerationStub(channel(f"{HOST}:{self.grpc_port}"))
        request = pb.generation.GenerateRequest(
            model=MODEL, max_tokens=case["max_tokens"],
            messages=[pb.generation.ChatMessage(**m) for m in case["messages"]],
            sampling=pb.common.SamplingParams(temperature=case.get("temperature", 0.0),
                                              seed=case.get("seed")))
        replies = list(stub.Generate(request, timeout=300,
                                     metadata=[("authorization", f"Bearer {self.api_key}")]))
        return replies[-1].request_id, [t for r in replies for t in r.token_ids]

    def grpc_record(self, request_id: str):
        stub = rpc.generation.GenerationStub(channel(f"{HOST}:{self.grpc_port}"))
        return stub.GetRequest(pb.generation.GetRequestRequest(request_id=request_id), timeout=60,
                               metadata=[("authorization", f"Bearer {self.api_key}")])

    def record(self, request_id: str) -> dict:
        status, body = self.call("GET", f"/v1/requests/{request_id}")
        expect(status == 200, f"GET /v1/requests/{request_id} answered {status}: {body}")
        return body

    def resume(self, request_id: str) -> dict:
        status, body = self.call("POST", f"/v1/requests/{request_id}/resume", {})
        expect(status == 200, f"resume {request_id} answered {status}: {body}")
        return body

    def first_answer(self, timeout: float = READY_TIMEOUT_SECONDS) -> None:
        """Waits until an authenticated chat completion answers 200."""
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            try:
                status, body = self.call("POST", "/v1/chat/completions",
                                         {"model": MODEL, "max_tokens": 1, "temperature": 0,
                                          "messages": [{"role": "user", "content": "Hi"}]},
                                         timeout=30)
                if status == 200:
                    return
                last = f"{status} {body}"
            except OSError as e:
                last = str(e)
            time.sleep(0.5)
        raise CheckFailed(f"no answer within {timeout:.0f} s: {last}")


# -- the steps ----------------------------------------------------------------------------------

def api_key_from_logs(compose: Compose) -> str:
    logs = compose.run("logs", "--no-color", "secrets")
    keys = re.findall(r"API key \(generated[^)]*\): (\S+)", logs)
    expect(len(keys) == 1, f"the secrets service printed {len(keys)} generated keys:\n{logs}")
    return keys[0]


def reference(image: str, data_volume: str, cases: list[dict]) -> list[dict]:
    script = (REPO_ROOT / "deploy" / "compose_reference.py").read_text()
    out = docker("run", "--rm", "-i", "--network", "none", "-v", f"{data_volume}:/data/dspark:ro",
                 "--entrypoint", "python", image, "-", json.dumps(cases), stdin=script,
                 timeout=900)
    return json.loads(out.strip().splitlines()[-1])


def model_file_mtime(image: str, data_volume: str) -> str:
    return docker("run", "--rm", "--network", "none", "-v", f"{data_volume}:/data/dspark:ro",
                  "--entrypoint", "sh", image, "-c",
                  "stat -c '%n %Y %s' /data/dspark/models/*/model.safetensors").strip()


class InBackground(threading.Thread):
    """Runs fn() on a thread; result() joins and returns its value or raises its error."""

    def __init__(self, fn) -> None:
        super().__init__(daemon=True)
        self.fn, self.value, self.error = fn, None, None

    def run(self) -> None:
        try:
            self.value = self.fn()
        except BaseException as e:  # handed to the caller of result()
            self.error = e

    def result(self, timeout: float = 900):
        self.join(timeout)
        if self.error is not None:
            raise self.error
        return self.value


def up(compose: Compose, client: Client, report: dict, label: str, on_up=None) -> None:
    """`up -d`, then waits for the first authenticated answer and a healthy scheduler; the API
    key is the one the secrets service generated at the first start. on_up() is called as soon
    as `up -d` returns (the model is prepared by then)."""
    started = time.monotonic()
    compose.run("up", "-d", *compose.services_to_start())
    up_returned = time.monotonic() - started
    if on_up is not None:
        on_up()
    if not client.api_key:
        client.api_key = api_key_from_logs(compose)
    client.first_answer()
    report[f"{label}_up_returned_seconds"] = round(up_returned, 1)
    report[f"{label}_up_to_first_answer_seconds"] = round(time.monotonic() - started, 1)
    wait_healthy(compose.container("scheduler"))
    log(f"{label} up: first authenticated answer "
        f"{report[f'{label}_up_to_first_answer_seconds']} s after `up -d`")


def check_exact(client: Client, refs: list[dict], report: dict) -> None:
    for i, (case, ref) in enumerate(zip(SHORT_CASES, refs)):
        body = client.chat(case)
        rest = body["dspark"]["token_ids"]
        record = client.record(body["id"])
        expect(record["prompt_token_ids"] == ref["prompt_ids"],
               f"case {i}: REST prompt ids differ from the chat template's")
        expect(rest == ref["output_ids"], f"case {i}: REST {rest} != embedded {ref['output_ids']}")
        _, streamed, _ = client.stream_chat(case)
        expect(streamed == ref["output_ids"],
               f"case {i}: REST stream {streamed} != embedded {ref['output_ids']}")
        _, over_grpc = client.grpc_generate(case)
        expect(over_grpc == ref["output_ids"],
               f"case {i}: gRPC {over_grpc} != embedded {ref['output_ids']}")
    report["compared_cases"] = len(refs)
    report["compared_tokens"] = sum(len(r["output_ids"]) for r in refs)
    log(f"REST, REST stream and gRPC equal the embedded engine on {len(refs)} prompts "
        f"({report['compared_tokens']} tokens each way)")


def check_seeded_repeats(client: Client, report: dict) -> list[int]:
    """SEEDED_CASE sent twice alone over REST, streamed beside a long request, and over gRPC:
    the same tokens every time. Returns them (compared again after `down` / `up`)."""
    first = client.chat(SEEDED_CASE)["dspark"]["token_ids"]
    expect(len(first) > 0, "the seeded request produced no tokens")
    again = client.chat(SEEDED_CASE)["dspark"]["token_ids"]
    expect(again == first, f"seeded request sent again: {again} != {first}")
    beside = InBackground(lambda: client.chat(LONG_CASES[0]))
    beside.start()
    _, streamed, _ = client.stream_chat(SEEDED_CASE)
    beside.result()
    expect(streamed == first, f"seeded request streamed beside another: {streamed} != {first}")
    _, over_grpc = client.grpc_generate(SEEDED_CASE)
    expect(over_grpc == first, f"seeded request over gRPC: {over_grpc} != {first}")
    report["seeded_repeats"] = 4
    report["seeded_tokens"] = len(first)
    log(f"a seeded T=1 request gave the same {len(first)} tokens 4 times (REST alone twice, "
        "streamed beside a long request, gRPC)")
    return first


def check_drafter_killed_mid_stream(compose: Compose, client: Client, case: dict, ref: dict,
                                    report: dict) -> None:
    drafter = compose.container("drafter")
    killed_at: list[int] = []

    def kill_after_first_chunk(tokens: list[int]) -> None:
        if tokens and not killed_at:
            killed_at.append(len(tokens))
            docker("kill", drafter)

    _, tokens, _ = client.stream_chat(case, on_chunk=kill_after_first_chunk)
    expect(bool(killed_at), "the stream ended before the drafter could be killed")
    expect(killed_at[0] < len(ref["output_ids"]),
           f"the drafter was killed after the last token ({killed_at[0]})")
    expect(tokens == ref["output_ids"],
           f"stream with the drafter killed: {tokens} != embedded {ref['output_ids']}")
    report["drafter_killed_after_tokens"] = killed_at[0]
    report["drafter_killed_stream_tokens"] = len(tokens)
    log(f"drafter killed after {killed_at[0]} of {len(tokens)} tokens: the stream completed "
        "with the embedded engine's output")
    compose.run("start", "drafter")
    wait_healthy(drafter)
    wait_healthy(compose.container("scheduler"))
    body = client.chat(case)
    expect(body["dspark"]["token_ids"] == ref["output_ids"],
           "after the drafter came back: output differs from the embedded engine")
    log("drafter started again: stack healthy, output exact")


def check_scheduler_restart(compose: Compose, client: Client, finished_case: dict,
                            finished_ref: dict, running_case: dict, running_ref: dict,
                            report: dict) -> None:
    finished = client.chat(finished_case)
    finished_id = finished["id"]
    restarted: list[int] = []
    restart = threading.Thread(target=compose.run, args=("restart", "scheduler"), daemon=True)
    stream_result: dict = {}

    def restart_after_first_chunk(tokens: list[int]) -> None:
        if tokens and not restarted:
            restarted.append(len(tokens))
            restart.start()

    def stream() -> None:
        try:
            stream_result["id"], stream_result["tokens"], _ = client.stream_chat(
                running_case, on_chunk=restart_after_first_chunk)
        except OSError as e:  # the restart may cut the connection
            stream_result["error"] = str(e)

    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    reader.join(timeout=300)
    expect(bool(restarted), "the stream ended before the scheduler could be restarted")
    restart.join(timeout=300)  # `restart` returns once the new container has started
    wait_healthy(compose.container("scheduler"))
    client.first_answer()

    record = client.record(finished_id)
    expect(record["output_token_ids"] == finished_ref["output_ids"] and
           record["status"] == "finished",
           f"finished request after the restart: {record}")
    resumed = client.resume(finished_id)
    expect(resumed["dspark"]["token_ids"] == finished_ref["output_ids"],
           "resume of a finished request after the restart does not return its whole output")

    running_id = stream_result.get("id") or ""
    expect(bool(running_id), f"the streamed request has no id: {stream_result}")
    record = client.record(running_id)
    stored = record["output_token_ids"]
    expect(stored == running_ref["output_ids"][:len(stored)],
           "the stored output of the interrupted request is not a prefix of the embedded one")
    received = stream_result.get("tokens")
    if received is not None:
        expect(stored[:len(received)] == received or received == running_ref["output_ids"],
               "the stored output lost tokens the client had received")
    over_grpc = client.grpc_record(running_id)
    expect(list(over_grpc.output_ids) == stored, "gRPC GetRequest differs from REST")
    resumed = client.resume(running_id)
    expect(resumed["dspark"]["token_ids"] == running_ref["output_ids"],
           f"resume after the restart: {resumed['dspark']['token_ids']} != embedded "
           f"{running_ref['output_ids']}")
    report["scheduler_restarted_after_tokens"] = restarted[0]
    report["scheduler_restart_stored_tokens"] = len(stored)
    report["scheduler_restart_status"] = record["status"]
    log(f"scheduler restarted after {restarted[0]} streamed tokens: the record held "
        f"{len(stored)} tokens ({record['status']}), resume completed all "
        f"{len(running_ref['output_ids'])}; the finished request was returned whole")


def check_down_then_up_again(compose: Compose, client: Client, image: str, data_volume: str,
                             case: dict, ref: dict, report: dict) -> None:
    volume_created = docker("volume", "inspect", "-f", "{{.CreatedAt}}", data_volume).strip()
    model_before = model_file_mtime(image, data_volume)
    compose.run("down")
    left = compose.running_containers()
    expect(not left, f"containers still running after down: {left}")
    log("down: no container of the project is running")
    up(compose, client, report, "second")
    expect(docker("volume", "inspect", "-f", "{{.CreatedAt}}", data_volume).strip()
           == volume_created, "the model volume was made again")
    expect(model_file_mtime(image, data_volume) == model_before,
           "the prepared model was written again")
    body = client.chat(case)
    expect(body["dspark"]["token_ids"] == ref["output_ids"], "after up again: output differs")
    log(f"up again reused the prepared model ({model_before.split()[0]}) and answered exactly")


def check_monitoring_running(compose: Compose, report: dict) -> None:
    for service in compose.monitoring:
        status = docker("inspect", "-f", "{{.State.Status}}", compose.container(service)).strip()
        expect(status == "running", f"{service} is {status}")
    report["monitoring_services"] = compose.monitoring
    log(f"monitoring profile running: {', '.join(compose.monitoring)}")


def dashboard_queries() -> list[str]:
    """The dashboard's panel expressions, with Grafana's variables filled as Grafana would."""
    dashboard = json.loads(DASHBOARD.read_text())
    return [t["expr"].replace("$__rate_interval", "1m").replace("$model", ".*")
            for panel in dashboard["panels"] for t in panel.get("targets", [])]


def prometheus_query(expr: str) -> list[dict]:
    """One instant query through Prometheus's HTTP API; its result vector."""
    url = f"http://{HOST}:{PROMETHEUS_PORT}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            body = json.loads(response.read())
    except urllib.error.HTTPError as e:  # a bad expression is a 400 with the error in the body
        body = json.loads(e.read())
    expect(body.get("status") == "success", f"Prometheus refused {expr!r}: {body.get('error')}")
    return body["data"]["result"]


def check_dashboard_queries(report: dict) -> None:
    """Prometheus scrapes the scheduler (its finished-request counter holds the traffic sent so
    far, after the next scrape), and every dashboard expression evaluates."""
    deadline = time.monotonic() + PROMETHEUS_TIMEOUT_SECONDS
    while True:
        up = prometheus_query('up{job="dspark-scheduler"}')
        served = prometheus_query("sum(dspark:request_success_total)")
        if up and up[0]["value"][1] == "1" and served and float(served[0]["value"][1]) > 0:
            break
        expect(time.monotonic() < deadline, f"Prometheus has not scraped the scheduler's traffic "
                                            f"in {PROMETHEUS_TIMEOUT_SECONDS:.0f} s (up: {up})")
        time.sleep(1.0)
    queries = dashboard_queries()
    with_data = [expr for expr in queries if prometheus_query(expr)]
    report["dashboard_queries"] = len(queries)
    report["dashboard_queries_with_data"] = len(with_data)
    log(f"Prometheus scrapes the scheduler; all {len(queries)} dashboard expressions evaluate, "
        f"{len(with_data)} with data")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--project", default="dsparkcheck")
    parser.add_argument("--file", action="append", dest="files",
                        default=None, help="compose files (default: docker-compose.yml and "
                                           "deploy/docker-compose.hostnet.yml)")
    parser.add_argument("--monitoring-service", action="append", dest="monitoring", default=[],
                        help="a monitoring profile service to start too (its image is here)")
    parser.add_argument("--image", default="dspark-serve:latest")
    parser.add_argument("--http-port", type=int, default=18000)
    parser.add_argument("--grpc-port", type=int, default=15050)
    parser.add_argument("--report", type=Path, default=None, help="JSON file for the measurements")
    args = parser.parse_args()
    files = args.files or ["docker-compose.yml", "deploy/docker-compose.hostnet.yml"]
    compose = Compose(args.project, files, args.monitoring)
    data_volume = compose.volume("dspark-data")
    report: dict = {}
    try:
        client = Client(args.http_port, args.grpc_port, api_key="")
        cases = SHORT_CASES + LONG_CASES
        # The reference runs while the services start.
        references = InBackground(lambda: reference(args.image, data_volume, cases))
        up(compose, client, report, "first", on_up=references.start)
        status, _ = client.call("GET", "/v1/models", key=None)
        expect(status == 401, f"/v1/models without a key answered {status}, not 401")
        status, _ = client.call("GET", "/v1/models", key="dsk-wrong")
        expect(status == 401, f"/v1/models with a wrong key answered {status}, not 401")
        log("API keys are on: no key or a wrong key gets 401")
        check_monitoring_running(compose, report)

        refs = references.result()
        short_refs, long_refs = refs[:len(SHORT_CASES)], refs[len(SHORT_CASES):]
        report["long_reference_tokens"] = [len(r["output_ids"]) for r in long_refs]
        check_exact(client, short_refs, report)
        seeded = check_seeded_repeats(client, report)
        if "prometheus" in compose.monitoring:
            check_dashboard_queries(report)
        check_drafter_killed_mid_stream(compose, client, LONG_CASES[0], long_refs[0], report)
        check_scheduler_restart(compose, client, SHORT_CASES[0], short_refs[0], LONG_CASES[1],
                                long_refs[1], report)
        check_down_then_up_again(compose, client, args.image, data_volume, SHORT_CASES[1],
                                 short_refs[1], report)
        after_restart = client.chat(SEEDED_CASE)["dspark"]["token_ids"]
        expect(after_restart == seeded,
               f"seeded request after down / up: {after_restart} != {seeded}")
        log("the seeded request gives the same tokens after down / up")
        report["passed"] = True
    except (CheckFailed, subprocess.TimeoutExpired, json.JSONDecodeError) as e:
        report["passed"] = False
        report["failure"] = str(e)
        log(f"FAILED: {e}")
    if args.report is not None:
        args.report.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
