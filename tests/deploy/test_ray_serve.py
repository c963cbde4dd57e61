"""deploy/ray_serve.py on one Ray cluster of three nodes on this host (a head and two workers with
one `dspark_cell` slot each; tests/deploy/ray_support.py), in order:

- without a cluster: every cell's configs share one fresh internal token;
- one cell: its scheduler replica is the ingress, so HTTP reaches the scheduler's FastAPI app with
  no router in between, and its methods still answer DeploymentHandle calls;
- two cells behind the router, sharing one Redis (a test prefix): each cell's three replicas on
  one worker node and the two cells on different nodes (`GET /cells` names them), concurrent
  greedy requests spread over both and equal to the embedded engine's token for token, each
  cell's verifier and drafter refusing calls without the cell's internal token;
- a worker node killed while 8 streams run: the router takes its cell out within seconds, new
  requests complete on the other cell, every interrupted stream is resumed on the live cell from
  its stored tokens with nothing lost, the whole output equal to an uninterrupted greedy run;
- the cell controller under a load ramp: the lost cell removed, a second cell started on a new
  node when the load is above target, drained and removed when it falls, no request failing;
- removing the applications closes every cell's ports.

A missing `ray` is an error here, not a skip: scripts/setup.sh installs ray[serve].
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import threading
import time
import urllib.error
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import ray

from dspark.serving.grpc_runtime import channel
from dspark.serving.protos import pb, rpc
from tests.deploy.ray_support import (
    dspark_apps, embedded_outputs, get_json, load_ray_serve_module, port_open, post, sse_events,
    streamed_token_ids, tiny_config, wait_for)

MAX_TOKENS = 12
LONG = 400  # tokens of the streams that a node loss interrupts
PROMPTS = [[3, 9, 27], [5, 6], [10, 11, 12, 13], [7], [40, 41, 2], [22, 23, 24, 25, 26]]
STREAM_PROMPTS = [[3, 9, 27], [5, 6], [10, 11, 12, 13], [7], [40, 41, 2], [22, 23, 24, 25, 26],
                  [8, 8, 9], [30, 31]]
CHAT = [{"role": "user", "content": "t5 t6 t7"}]
CHAT_IDS = [1, 5, 6, 7, 2, 3]  # CHAT in the tiny chat template: t1 <content> t2, then t3
REDIS_URL = "redis://127.0.0.1:6379/0"


def bound_init_args(app) -> tuple:
    """The arguments a deployment of an application graph was bound with (Ray Serve's
    Application -> Deployment.init_args)."""
    return app._bound_deployment.init_args


def test_every_cell_gets_its_own_internal_token(monkeypatch):
    """build_app on a pretend two-node cluster: the three service configs of a cell carry one
    internal token, another cell and the next deployment other ones; each cell is pinned to its
    own node by node id, and the router binds the cell applications by name."""
    rs = load_ray_serve_module()
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 16.0})
    monkeypatch.setattr(ray, "nodes", lambda: [
        {"Alive": True, "Resources": {"CPU": 8.0}, "NodeManagerAddress": "10.0.0.1",
         "NodeID": node_id} for node_id in ("b" * 56, "a" * 56)])
    config = rs.RayServeConfig(cells=2, verifier_gpus=0, drafter_gpus=0)

    def tokens_of(apps) -> list[str]:
        (router_name, router), = [(n, a) for n, a in apps if n == rs.APP_NAME]
        cells = [(n, a) for n, a in apps if n != rs.APP_NAME]
        assert bound_init_args(router)[0] == [n for n, _ in cells] == ["dspark-cell0",
                                                                        "dspark-cell1"]
        tokens, nodes = [], []
        for _, scheduler_app in cells:
            cell, verifier_app, drafter_app, scheduler_config = bound_init_args(scheduler_app)
            verifier_config, = bound_init_args(verifier_app)
            drafter_config, = bound_init_args(drafter_app)
            configs = (verifier_config, drafter_config, scheduler_config)
            assert len({c.internal_token_value for c in configs}) == 1
            assert all("internal_token=" not in repr(c) for c in configs)
            tokens.append(scheduler_config.internal_token_value)
            selectors = {str(a._bound_deployment.ray_actor_options["label_selector"])
                         for a in (verifier_app, drafter_app, scheduler_app)}
            assert len(selectors) == 1
            nodes.append(selectors.pop())
        assert len(set(nodes)) == 2  # one cell per node
        return tokens

    first, second = tokens_of(rs.build_app(config)), tokens_of(rs.build_app(config))
    assert len(set(first + second)) == 4 and all(len(t) >= 32 for t in first)


def test_one_cell_serves_the_scheduler_app_itself(tiny_models, ray_cluster):
    """One cell: the application's ingress is the cell's scheduler replica, so Ray's proxy hands
    HTTP straight to the scheduler's FastAPI app (its schema, no router, no x-dspark-cell), and
    the replica's methods still answer DeploymentHandle calls."""
    from ray import serve

    rs = load_ray_serve_module()
    models = tiny_models
    try:
        url = rs.deploy(tiny_config(rs, models, cells=1, http_port=ray_cluster.http_port))
        deployments = serve.status().applications[rs.APP_NAME].deployments
        assert set(deployments) == {"cell0-verifier", "cell0-drafter", "cell0-scheduler"}

        schema = get_json(f"{url}/openapi.json")
        assert schema["info"]["title"] == "DSpark Serve"
        assert {"/v1/completions", "/v1/chat/completions", "/v1/requests/{request_id}",
                "/health", "/cells"} <= set(schema["paths"])
        cell, = get_json(f"{url}/cells")["cells"]
        assert set(cell) == set(rs.CELL_INFO_FIELDS)  # what the router lists for every cell
        assert cell["cell"] == 0
        assert cell["node_id"] in {w.node_id for w in ray_cluster.workers}
        addresses = [cell["verifier"], cell["drafter"], cell["http"], cell["grpc"]]
        assert len(set(addresses)) == 4 and all(port_open(a) for a in addresses)

        _, routed_by, chat_data = post(f"{url}/v1/chat/completions",
                                       {"model": "tiny", "messages": CHAT,
                                        "max_tokens": MAX_TOKENS, "temperature": 0})
        assert routed_by is None  # no router in between
        chat_body = json.loads(chat_data)
        assert chat_body["object"] == "chat.completion"
        expected_chat, expected = embedded_outputs(models, [CHAT_IDS, PROMPTS[0]], MAX_TOKENS)
        assert chat_body["dspark"]["token_ids"] == expected_chat
        stored = get_json(f"{url}/v1/requests/{chat_body['id']}")
        assert stored["output_token_ids"] == chat_body["dspark"]["token_ids"]

        stream_headers, _, stream_data = post(f"{url}/v1/completions",
                                              {"model": "tiny", "prompt": PROMPTS[0],
                                               "max_tokens": MAX_TOKENS, "temperature": 0,
                                               "stream": True})
        assert streamed_token_ids(stream_headers, stream_data) == expected

        handle = serve.get_deployment_handle("cell0-scheduler", rs.APP_NAME)
        assert handle.info.remote().result(timeout_s=60)["http"] == cell["http"]
        status, content_type, body = handle.forward.remote("GET", "/health", {}, b"").result(
            timeout_s=60)
        assert status == 200 and content_type == "application/json"
        assert json.loads(body)["status"] == "ok"
    finally:
        rs.undeploy()
    assert not dspark_apps()
    assert not [a for a in addresses if port_open(a)]


@pytest.fixture(scope="module")
def two_cells(tiny_models, ray_cluster):
    """Two cells and the router, request state in one Redis under a prefix of this run's own."""
    import redis

    rs = load_ray_serve_module()
    prefix = f"dspark-test-ray-{uuid.uuid4().hex[:8]}:"
    config = tiny_config(rs, tiny_models, cells=2, http_port=ray_cluster.http_port,
                         redis_url=REDIS_URL, redis_prefix=prefix, health_period_s=0.5,
                         health_timeout_s=3.0, health_failures=2)
    started = time.monotonic()
    url = rs.deploy(config)
    print(f"two cells deployed in {time.monotonic() - started:.1f} s")
    try:
        yield rs, config, url
    finally:
        rs.undeploy()
        client = redis.Redis.from_url(REDIS_URL)
        keys = list(client.scan_iter(f"{prefix}*"))
        if keys:
            client.delete(*keys)


@pytest.fixture(scope="module")
def long_references(tiny_models):
    return embedded_outputs(tiny_models, STREAM_PROMPTS, LONG)


def test_two_cells_on_two_nodes_serve_embedded_greedy_outputs(tiny_models, ray_cluster,
                                                             two_cells):
    from ray import serve

    rs, _, url = two_cells
    models = tiny_models
    assert url == f"http://127.0.0.1:{ray_cluster.http_port}"
    cells = get_json(f"{url}/cells")["cells"]
    assert sorted(c["cell"] for c in cells) == [0, 1]
    assert all(set(rs.CELL_INFO_FIELDS) <= set(c) for c in cells)  # known or null, never missing

    def all_known():
        listed = get_json(f"{url}/cells")["cells"]
        return listed if all(c["node_id"] for c in listed) else None

    # On a loaded machine a cell's first check can time out: its fields fill in at a later one.
    cells = wait_for(all_known, 60, "the router to know both cells' nodes")
    # Each cell on its own worker node, its three replicas together there.
    workers = {w.node_id for w in ray_cluster.workers}
    assert {c["node_id"] for c in cells} == workers
    for c in cells:
        app = rs.cell_app_name(c["cell"])
        for service in ("verifier", "drafter"):
            handle = serve.get_deployment_handle(f"cell{c['cell']}-{service}", app)
            assert handle.get_node_id.remote().result(timeout_s=60) == c["node_id"]
        assert c["healthy"] and not c["draining"]
    addresses = [a for c in cells for a in (c["verifier"], c["drafter"], c["http"], c["grpc"])]
    assert len(set(addresses)) == 8 and all(port_open(a) for a in addresses)
    # Only their scheduler may call a cell's verifier and drafter (the internal token).
    for cell in cells:
        for address, stub_class in ((cell["verifier"], rpc.verifier.VerifierStub),
                                    (cell["drafter"], rpc.drafter.DrafterStub)):
            with pytest.raises(grpc.RpcError) as e:
                stub_class(channel(address)).Info(pb.common.InfoRequest(), timeout=30)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED

    def complete(prompt):
        _, cell, data = post(f"{url}/v1/completions",
                             {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS,
                              "temperature": 0})
        return cell, json.loads(data)

    with ThreadPoolExecutor(len(PROMPTS) + 2) as pool:
        completions = list(pool.map(complete, PROMPTS))
        chat = pool.submit(post, f"{url}/v1/chat/completions",
                           {"model": "tiny", "messages": CHAT, "max_tokens": MAX_TOKENS,
                            "temperature": 0})
        streamed = pool.submit(post, f"{url}/v1/completions",
                               {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS,
                                "temperature": 0, "stream": True})
        _, _, chat_data = chat.result()
        stream_headers, _, stream_data = streamed.result()

    # Every request was served by one of the two cells, and both cells served some.
    assert {cell for cell, _ in completions} == {"0", "1"}
    expected = embedded_outputs(models, [*PROMPTS, CHAT_IDS], MAX_TOKENS)
    for prompt, (_, body), want in zip(PROMPTS, completions, expected):
        assert body["dspark"]["token_ids"] == want, prompt
        assert body["usage"]["completion_tokens"] == len(want)
        assert body["choices"][0]["text"] == " ".join(f"t{i}" for i in want)
    chat_body = json.loads(chat_data)
    assert chat_body["object"] == "chat.completion"
    assert chat_body["dspark"]["token_ids"] == expected[-1]
    # Server-sent events come through the router as events, in order, ending in [DONE].
    assert streamed_token_ids(stream_headers, stream_data) == expected[0]

    # Stored requests (one Redis for both cells) are found whichever cell ran them.
    for _, body in completions:
        stored = get_json(f"{url}/v1/requests/{body['id']}")
        assert stored["status"] == "finished"
        assert stored["output_token_ids"] == body["dspark"]["token_ids"]

    # A client error is the scheduler's own 4xx, passed through unchanged.
    with pytest.raises(urllib.error.HTTPError) as refused:
        post(f"{url}/v1/completions", {"model": "nope", "prompt": [1], "max_tokens": 2})
    assert refused.value.code == 404
    assert json.loads(refused.value.read())["error"]["code"] == 404


def test_a_seeded_request_repeats_on_either_cell(tiny_models, two_cells):
    """A seeded T = 1 request gives the same tokens on either cell, sent alone or beside unseeded
    requests, and the embedded engine's tokens for that seed (docs/seeded_sampling.md)."""
    from dspark.sampling import SamplingParams

    _, _, url = two_cells
    prompt, seed, max_tokens = [5, 6, 7], 4321, 40
    seeded = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 1.0,
              "seed": seed}

    def complete(body):
        _, cell, data = post(f"{url}/v1/completions", body)
        return cell, json.loads(data)["dspark"]["token_ids"]

    alone = [complete(seeded) for _ in range(4)]  # equally loaded cells take turns
    with ThreadPoolExecutor(len(PROMPTS) + 4) as pool:
        crowd = [pool.submit(complete, {"model": "tiny", "prompt": p, "max_tokens": 30,
                                        "temperature": 1.0}) for p in PROMPTS]
        beside = [pool.submit(complete, seeded) for _ in range(4)]
        beside = [f.result() for f in beside]
        assert all(len(f.result()[1]) > 0 for f in crowd)
    want = embedded_outputs(tiny_models, [prompt], max_tokens,
                            SamplingParams(temperature=1.0, seed=seed))[0]
    assert len(want) > 0
    runs = alone + beside
    assert {cell for cell, _ in runs} == {"0", "1"}, [cell for cell, _ in runs]
    assert all(tokens == want for _, tokens in runs), [(cell, t[:8]) for cell, t in runs]


class Stream(threading.Thread):
    """One streamed completion read event by event: its id, cell, tokens as they came, how it
    ended ("done", "lost": the router's cell_lost event, or "error: ...")."""

    def __init__(self, port: int, body: dict, path: str = "/v1/completions") -> None:
        super().__init__(daemon=True)
        self.port, self.body, self.path = port, body, path
        self.request_id = self.cell = None
        self.tokens: list[int] = []
        self.end = ""
        self.started = time.monotonic()
        self.ended_at = None

    def run(self) -> None:
        try:
            connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
            connection.request("POST", self.path, json.dumps(self.body),
                               {"Content-Type": "application/json"})
            reply = connection.getresponse()
            self.cell = reply.headers.get("x-dspark-cell")
            if reply.status != 200:
                self.end = f"error: {reply.status} {reply.read()[:200]!r}"
                return
            while line := reply.readline():
                for event in sse_events(line):
                    if event == "[DONE]":
                        self.end = "done"
                        return
                    parsed = json.loads(event)
                    if "error" in parsed:
                        self.end = "lost" if parsed["error"]["type"] == "cell_lost" \
                            else f"error: {parsed['error']}"
                        return
                    self.request_id = parsed["id"]
                    self.tokens += parsed["dspark"]["token_ids"]
            self.end = "error: the stream ended without [DONE]"
        except Exception as e:
            self.end = f"error: {type(e).__name__}: {e}"
        finally:
            self.ended_at = time.monotonic()


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_a_node_lost_mid_stream(ray_cluster, two_cells, long_references):
    rs, config, url = two_cells
    cells = {str(c["cell"]): c for c in get_json(f"{url}/cells")["cells"]}
    streams = [Stream(ray_cluster.http_port,
                      {"model": "tiny", "prompt": p, "max_tokens": LONG, "temperature": 0,
                       "stream": True}) for p in STREAM_PROMPTS]
    for s in streams:
        s.start()
    wait_for(lambda: all(s.tokens or s.end for s in streams), 120, "every stream's first tokens")
    victim = max(cells, key=lambda c: sum(s.cell == c and not s.end for s in streams))
    survivor = next(c for c in cells if c != victim)
    in_flight = sum(not s.end for s in streams)
    on_victim = sum(s.cell == victim and not s.end for s in streams)
    node, = [w for w in ray_cluster.workers if w.node_id == cells[victim]["node_id"]]
    killed = time.monotonic()
    ray_cluster.remove_worker(node)

    # New requests throughout, one after another: when each came back, from which cell.
    answers: list[tuple[float, float, str, str]] = []  # (sent, answered, cell, error)
    stop_asking = threading.Event()

    def ask() -> None:
        while not stop_asking.is_set():
            sent = time.monotonic()
            try:
                _, cell, data = post(f"{url}/v1/completions",
                                     {"model": "tiny", "prompt": [4, 5], "max_tokens": 4,
                                      "temperature": 0}, timeout=60)
                answers.append((sent, time.monotonic(), cell, ""))
            except Exception as e:
                answers.append((sent, time.monotonic(), "", f"{type(e).__name__}: {e}"))
                time.sleep(0.2)

    asker = threading.Thread(target=ask, daemon=True)
    asker.start()

    def victim_out():
        cell = {str(c["cell"]): c for c in get_json(f"{url}/cells")["cells"]}.get(victim)
        return cell is None or not cell["healthy"]

    wait_for(victim_out, 60, "the router to take the lost cell out", period=0.1)
    noticed = time.monotonic()
    wait_for(lambda: all(s.end for s in streams), 180, "every stream to end")
    wait_for(lambda: any(a[1] > noticed + 2 for a in answers), 60, "answers after the notice")
    stop_asking.set()
    asker.join(90)

    interrupted = [s for s in streams if s.end != "done"]
    assert all(s.end == "lost" for s in interrupted), [s.end for s in interrupted]
    assert interrupted, "no stream was running on the lost cell"
    assert all(s.cell == victim for s in interrupted)
    lost_tokens, resumed_tokens = 0, 0
    for s in streams:
        reference = long_references[streams.index(s)]
        if s.end == "done":
            assert s.tokens == reference
            continue
        stored = get_json(f"{url}/v1/requests/{s.request_id}")
        assert stored["status"] == "interrupted"
        kept = stored["output_token_ids"]
        lost_tokens += len(s.tokens) - common_prefix(s.tokens, kept)
        headers, cell, data = post(f"{url}/v1/requests/{s.request_id}/resume", {"stream": True})
        assert cell == survivor
        rest = streamed_token_ids(headers, data)
        resumed_tokens += len(rest)
        assert kept + rest == reference
        assert get_json(f"{url}/v1/requests/{s.request_id}")["output_token_ids"] == reference

    finished = [s.ended_at - s.started for s in streams if s.end == "done"]
    served = [a for a in answers if not a[3]]
    first_answer = min(a[1] for a in served if a[0] >= killed) - killed
    errors_after_notice = [a for a in answers if a[3] and a[0] >= noticed]
    print(f"node lost: {in_flight} streams in flight ({on_victim} on the lost cell), "
          f"{len(interrupted)} interrupted and resumed ({resumed_tokens} tokens after the resume), "
          f"{lost_tokens} tokens lost; router noticed after {noticed - killed:.1f} s; first new "
          f"answer {first_answer:.1f} s after the loss; {len(served)} new requests served, "
          f"{len(answers) - len(served)} failed ({len(errors_after_notice)} after the notice); "
          f"the uninterrupted streams took {min(finished or [0]):.1f}-{max(finished or [0]):.1f} s")
    assert lost_tokens == 0
    assert noticed - killed < 10
    assert not errors_after_notice
    assert {a[2] for a in served if a[0] >= noticed} == {survivor}


def test_cells_follow_the_load(tiny_models, ray_cluster, two_cells, long_references):
    """After the node loss, the cell controller against the real router and Serve, stepped by
    the test on a clock of its own (the delays themselves: test_ray_cell_controller.py): the
    lost cell removed; with a new node and 4 requests in flight (2 per cell wanted) a second cell
    starts there and serves (stepped again, as the controller's loop does, if a start fails);
    with 2 streams left, one on each cell, the newest cell drains while
    its stream runs, the stream goes on to its end, and the cell is removed; every request of the
    ramp completes with the greedy output."""
    rs, config, url = two_cells
    auto = dataclasses.replace(config, min_cells=1, max_cells=2, target_ongoing_requests=2,
                               upscale_delay_s=1.0, downscale_delay_s=1.0)
    now = [0.0]
    controller = rs.CellController(auto, clock=lambda: now[0])
    router = controller.router
    results: list[Stream] = []

    def stream(i: int, max_tokens: int) -> Stream:
        s = Stream(ray_cluster.http_port, {"model": "tiny", "prompt": STREAM_PROMPTS[i],
                                           "max_tokens": max_tokens, "temperature": 0,
                                           "stream": True})
        s.prompt_index = i
        results.append(s)
        return s

    def in_flight() -> int:
        return sum(c["in_flight"] for c in router.load.remote().result(timeout_s=60).values())

    did = controller.step()
    survivor, = [c["cell"] for c in get_json(f"{url}/cells")["cells"]]
    assert did["lost"] == [rs.cell_app_name(1 - survivor)] and did["cells"] == 1
    ray_cluster.add_worker()  # room for a second cell

    # Load up: 4 clients back to back, 4 in flight > 2 per cell.
    load_on = threading.Event()
    load_on.set()

    def client(i: int) -> None:
        while load_on.is_set():
            stream(i, 100).run()

    clients = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(4)]
    for c in clients:
        c.start()
    ramp = time.monotonic()
    wait_for(lambda: in_flight() >= 3, 120, "the load on the cell")
    assert controller.step()["added"] == []  # above the target since now
    now[0] += 1.0
    wait_for(lambda: in_flight() >= 3, 120, "the load on the cell")
    stepped: list[dict | Exception] = []

    def scale_out() -> None:
        """Steps as the controller's loop does (a step that fails is followed by the next), until
        one adds a cell: a start can fail when the node it was placed on dies meanwhile."""
        for _ in range(3):
            try:
                stepped.append(controller.step())  # returns once the new cell serves
            except Exception as e:
                stepped.append(e)
                print(f"cells: step failed: {type(e).__name__}: {e}")
                continue
            if stepped[-1]["added"]:
                return

    scaling = threading.Thread(target=scale_out, daemon=True)
    scaling.start()
    scaling.join(600)
    load_on.clear()
    for c in clients:
        c.join(120)
    assert stepped and isinstance(stepped[-1], dict) and stepped[-1]["added"], stepped
    new_app, = stepped[-1]["added"]
    new_cell = int(new_app.removeprefix("dspark-cell"))
    scaled_out = time.monotonic() - ramp
    cells = get_json(f"{url}/cells")["cells"]
    assert {c["cell"] for c in cells} == {survivor, new_cell}
    assert {c["node_id"] for c in cells} == {w.node_id for w in ray_cluster.workers}

    # Load down to 2 long streams, one per cell (least loaded first): 1 cell wanted; the newest
    # of two equally busy cells drains with its stream running.
    tail = []
    for i in (0, 1):
        tail.append(stream(i, LONG))
        tail[-1].start()
        wait_for(lambda: tail[-1].tokens or tail[-1].end, 120, "a stream's first tokens")
    assert {s.cell for s in tail} == {str(survivor), str(new_cell)}
    assert controller.step()["draining"] == []
    now[0] += 1.0
    drained = controller.step()
    assert drained["draining"] == [new_app], drained
    on_drained, = [s for s in tail if s.cell == str(new_cell)]
    while_draining = not on_drained.end  # the stream was still running when the drain began
    removed = []
    for _ in range(600):  # until the drained cell's stream has ended
        now[0] += 1.0
        removed = controller.step()["removed"]
        if removed:
            break
        time.sleep(0.5)
    assert removed == [new_app] and on_drained.end == "done"
    for s in tail:
        s.join(300)
    assert {c["cell"] for c in get_json(f"{url}/cells")["cells"]} == {survivor}
    wait_for(lambda: new_app not in dspark_apps(), 60, "the new cell's application to go")

    failed = [(s.cell, s.end) for s in results
              if s.end != "done" or len(s.tokens) != s.body["max_tokens"]
              or s.tokens != long_references[s.prompt_index][:len(s.tokens)]]
    print(f"cells under load: the second cell serving {scaled_out:.1f} s after the ramp began; "
          f"{len(results)} requests, {len(failed)} failed; the new cell drained with "
          f"{drained['draining_in_flight'][0]} stream in flight (still running: {while_draining})"
          f"; {sum(s.cell == str(new_cell) for s in results)} requests served by the new cell")
    assert failed == []
    assert drained["draining_in_flight"] == [1] and while_draining


def test_removing_the_applications_closes_every_cell(two_cells):
    rs, _, url = two_cells
    cells = get_json(f"{url}/cells")["cells"]
    addresses = [a for c in cells for a in (c["verifier"], c["drafter"], c["http"], c["grpc"])]
    assert addresses and all(port_open(a) for a in addresses)
    rs.undeploy()
    assert not dspark_apps()
    assert not [a for a in addresses if port_open(a)]
