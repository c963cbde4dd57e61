"""`dspark up`: the whole service stack as local processes on loopback (docs/design.md section 10).

Starts the verifier, then the drafter (when there is a drafter checkpoint), then the scheduler,
each as its own `python -m services.<name>` process, waits until each answers its health check,
and prints where the APIs are. Ctrl-C (or SIGTERM) stops it cleanly: the scheduler first (it
drains in-flight requests), then the drafter and the verifier. If any service dies, the others
are stopped too and the exit code is 1.

Secrets never travel on a command line (any local user can read those in `ps`): API keys come
from the scheduler's environment (DSPARK_SCHEDULER_API_KEYS, inherited) or a file
(`--api-keys-file`), and the internal token that the verifier and the drafter demand of the
scheduler is generated here, fresh for each run, and handed to the three by environment.
"""

from __future__ import annotations

import argparse
import secrets
import signal
import sys
import tempfile
import threading
from pathlib import Path

from dspark.devices import add_device_argument
from dspark.serving.local_stack import ServiceProcess, wait_grpc, wait_http


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int, default=8000, help="OpenAI REST port")
    parser.add_argument("--grpc-port", type=int, default=50050, help="gRPC Generation port")
    parser.add_argument("--verifier-port", type=int, default=50052)
    parser.add_argument("--drafter-port", type=int, default=50051)
    parser.add_argument("--host", default="127.0.0.1", help="address the scheduler listens on")
    parser.add_argument("--model-dir", default="", help="target folder (default: prepared SmolLM2)")
    parser.add_argument("--drafter-dir", default="",
                        help="drafter checkpoint (default: the shipped one; none = target only)")
    parser.add_argument("--model-name", default="dspark", help="the model name clients send")
    parser.add_argument("--policy", default="async_topk")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--weights", default="auto", choices=["auto", "q4", "dense"],
                        help="the verifier's target linears: the GGUF's own blocks (q4), dense "
                             "tensors, or auto (q4 where the GGUF and the CPU kernel are)")
    parser.add_argument("--verification", default="token",
                        choices=["token", "block", "drafter-invariant"],
                        help="how the verifier accepts sampled requests' drafts: token by token "
                             "or the whole block at once (both exact)")
    add_device_argument(parser, help_suffix="; the verifier's and the drafter's (docs/gpu.md)")
    parser.add_argument("--verifier-threads", type=int, default=0,
                        help="torch threads of the verifier (0: all the cores, or those the "
                             "drafter leaves with several --cohorts)")
    parser.add_argument("--drafter-threads", type=int, default=0,
                        help="torch threads of the drafter (0: all the cores, or one with "
                             "several --cohorts)")
    parser.add_argument("--redis-url", default="", help="redis://... (default: in-memory store)")
    parser.add_argument("--api-keys-file", default="",
                        help="file of accepted Bearer keys, one a line (or set "
                             "DSPARK_SCHEDULER_API_KEYS in the environment); none = no auth")
    parser.add_argument("--cost-table", default="", help="SPS(B) JSON for the verifier")
    parser.add_argument("--log-dir", default="", help="service logs here (default: a temp folder)")
    parser.add_argument("--extra-scheduler-args", default="",
                        help="more scheduler flags, space-separated")


def stack_processes(args: argparse.Namespace, log_dir: Path, internal_token: str = ""
                    ) -> list[tuple[ServiceProcess, str]]:
    """(process, readiness target) in start order; the target is host:port or an HTTP port.
    `internal_token` reaches each service by environment (DSPARK_<SERVICE>_INTERNAL_TOKEN)."""

    def secret_env(service: str) -> dict[str, str]:
        return {f"DSPARK_{service}_INTERNAL_TOKEN": internal_token} if internal_token else {}

    from dspark.admission import AdmissionPolicy
    from dspark.drafter_choice import drafter_dir_or_shipped
    from dspark.serving.core_split import scheduler_cohorts, split_cores

    drafter_dir = drafter_dir_or_shipped(args.drafter_dir)
    use_drafter = drafter_dir is not None and AdmissionPolicy.parse(args.policy).drafts
    threads = split_cores(use_drafter, scheduler_cohorts(args.extra_scheduler_args.split()),
                          verifier=args.verifier_threads, drafter=args.drafter_threads)
    common = ["--dtype", args.dtype, "--device", args.device]
    model = ["--model-dir", args.model_dir] if args.model_dir else []
    verifier = ["services.verifier", "--port", str(args.verifier_port), *model, *common,
                "--threads", str(threads.verifier), "--verification", args.verification,
                "--weights", args.weights,
                "--hidden-layer-ids", "" if use_drafter else "none"]
    if use_drafter:
        verifier += ["--drafter-dir", str(drafter_dir)]
    if args.cost_table:
        verifier += ["--cost-table", args.cost_table]
    out = [(ServiceProcess("verifier", verifier, log_dir, env=secret_env("VERIFIER")),
            f"127.0.0.1:{args.verifier_port}")]
    if use_drafter:
        out.append((ServiceProcess("drafter", [
            "services.drafter", "--port", str(args.drafter_port),
            "--drafter-dir", str(drafter_dir), *model, *common,
            "--threads", str(threads.drafter), "--verification", args.verification], log_dir,
            env=secret_env("DRAFTER")),
            f"127.0.0.1:{args.drafter_port}"))
    scheduler = ["services.scheduler", "--host", args.host, "--http-port", str(args.port),
                 "--grpc-port", str(args.grpc_port), "--verifier", f"127.0.0.1:{args.verifier_port}",
                 "--drafter", f"127.0.0.1:{args.drafter_port}" if use_drafter else "",
                 "--model-name", args.model_name, "--policy", args.policy, *model,
                 "--redis-url", args.redis_url, *args.extra_scheduler_args.split()]
    env = secret_env("SCHEDULER")
    if args.api_keys_file:
        env["DSPARK_SCHEDULER_API_KEYS_FILE"] = str(Path(args.api_keys_file).resolve())
    out.append((ServiceProcess("scheduler", scheduler, log_dir, env=env), str(args.port)))
    return out


def run(args: argparse.Namespace) -> int:
    from dspark.admission import AdmissionPolicy
    from dspark.serving.core_split import split_cores

    try:
        AdmissionPolicy.parse(args.policy)
        split_cores(True, verifier=args.verifier_threads, drafter=args.drafter_threads)
    except ValueError as e:  # before any service starts (the scheduler would refuse it too)
        print(f"dspark up: {e}", file=sys.stderr)
        return 1
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="dspark-up-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    started: list[ServiceProcess] = []
    code = 0
    try:
        token = secrets.token_urlsafe(32)  # fresh for each run; never printed
        for proc, target in stack_processes(args, log_dir, token):
            print(f"dspark up: starting {proc.name} (log {log_dir / (proc.name + '.log')})",
                  file=sys.stderr, flush=True)
            started.append(proc.start())
            if proc.name == "scheduler":
                wait_http(proc, int(target))
            else:
                wait_grpc(proc, target)
        print(f"dspark up: ready. REST http://{args.host}:{args.port}/v1  gRPC "
              f"{args.host}:{args.grpc_port}  (Ctrl-C stops)", file=sys.stderr, flush=True)
        while not stop.wait(0.5):
            dead = [p.name for p in started if not p.alive()]
            if dead:
                print(f"dspark up: {', '.join(dead)} exited; stopping the stack", file=sys.stderr)
                code = 1
                break
    except (RuntimeError, TimeoutError) as e:
        print(f"dspark up: {e}", file=sys.stderr)
        code = 1
    finally:
        for proc in reversed(started):  # scheduler first: it drains, then its backends go
            proc.stop()
        print("dspark up: stopped", file=sys.stderr, flush=True)
    return code
