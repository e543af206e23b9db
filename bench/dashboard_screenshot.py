"""Prometheus' graph of `ray_rayft_loss` while a real job trains, photographed by headless Chromium.

The README's local monitoring recipe, run as a user would: a one-node Ray cluster with a metrics port, Debian's
Prometheus scraping Ray's service-discovery file, the tiny demo job through `ray job submit`. Once the run has
logged a few steps, and while it still trains, Chromium renders Prometheus' graph page for the loss; the JSON
records the losses Prometheus held at that moment next to those in `metrics.jsonl`, so the picture can be checked.
Needs `chromium` (Debian's package) and installs `prometheus` where missing, as the tests do. Never runs in CI.

    python bench/dashboard_screenshot.py   # → bench/results/prometheus_rayft_loss.png + dashboard_screenshot_cpu.json
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

import yaml
from _common import free_port, machine
from fixtures import prometheus as prom

from rayft import demo

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
RAY = Path(sys.executable).parent / "ray"
RUN = "screenshot_run"
STEPS_BEFORE_SHOT = 20
PEAK_TFLOPS = 0.2  # as tests/conftest.py: a stated CPU peak so that the MFU panels have values too


def start_ray(temp_dir: Path, env: dict[str, str]) -> tuple[subprocess.Popen, str, int]:
    """`ray start --head --block` on free ports; returns the process, the dashboard URL and the metrics port."""
    gcs, dash, metrics = free_port(), free_port(), free_port()
    proc = subprocess.Popen(
        [str(RAY), "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(gcs),
         "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dash), "--metrics-export-port", str(metrics),
         "--temp-dir", str(temp_dir), "--num-cpus", "8", "--disable-usage-stats"],
        env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{dash}"
    wait_until(lambda: _answers(f"{url}/api/version"), 120, "Ray's dashboard")
    return proc, url, metrics


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the process group this script started (by its PID), SIGKILL what is left."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def wait_until(ready, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not ready after {timeout:.0f}s")
        time.sleep(1)


def _answers(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=2)
        return True
    except OSError:
        return False


def job_config(root: Path) -> Path:
    """The demo job, logging every step, long enough to be photographed while it trains."""
    cfg = demo.prepare(root)
    cfg["train"].update(logging_steps=1, max_steps=60, eval_steps=30, save_steps=30, peak_tflops=PEAK_TFLOPS)
    cfg["ray"]["name"] = RUN
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def logged_losses(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    return [{"step": r["step"], "loss": r["loss"]} for r in rows if "loss" in r]


def graph_url(server: prom.Prometheus) -> str:
    """Prometheus' classic graph page for the loss over the last 2 minutes, one-second resolution."""
    query = {"g0.expr": f'ray_rayft_loss{{run="{RUN}"}}', "g0.tab": "0", "g0.range_input": "2m", "g0.step_input": "1"}
    return f"{server.url}/graph?{urllib.parse.urlencode(query)}"


def screenshot(url: str, png: Path) -> None:
    """Headless Chromium renders the page (its scripts draw the graph within the virtual-time budget)."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise RuntimeError("chromium not found: apt-get install chromium")
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run(
            [chromium, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={profile}",
             "--window-size=1400,900", "--virtual-time-budget=15000", f"--screenshot={png}", url],
            check=True, capture_output=True, timeout=120,
        )  # fmt: skip
    if not png.exists() or png.read_bytes()[:8] != b"\x89PNG\r\n\x1a\n":
        raise RuntimeError(f"chromium wrote no PNG at {png}")


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="rayft-shot-"))
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    head, dashboard, _ = start_ray(work / "ray", env)
    server, job = None, None
    try:
        sd_file = work / "ray" / "session_latest" / prom.SD_FILE
        wait_until(sd_file.exists, 60, f"Ray's {sd_file.name}")
        server = prom.start(prom.ensure_binary(), sd_file, work / "prometheus", free_port())
        prom.wait_for_targets(server, 1)
        config = job_config(work / "demo")
        run_dir = Path(yaml.safe_load(config.read_text())["train"]["output_dir"]) / RUN
        job = subprocess.Popen(
            [str(RAY), "job", "submit", "--address", dashboard, "--working-dir", str(REPO), "--",
             "python", "jobs/mistral4.py", "--config", str(config)],
            env=env, cwd=REPO, stdout=(work / "job.log").open("w"), stderr=subprocess.STDOUT,
        )  # fmt: skip
        wait_until(lambda: len(logged_losses(run_dir)) >= STEPS_BEFORE_SHOT or job.poll() is not None, 600, "the run")
        if job.poll() is not None:
            raise RuntimeError(
                f"the job ended before {STEPS_BEFORE_SHOT} steps: {(work / 'job.log').read_text()[-3000:]}"
            )
        time.sleep(3)  # one more scrape of the newest step
        png = RESULTS / "prometheus_rayft_loss.png"
        screenshot(graph_url(server), png)
        held = server.api("query_range", query=f'ray_rayft_loss{{run="{RUN}"}}', start=time.time() - 300,
                          end=time.time(), step=1)["result"]  # fmt: skip
        still_training = job.poll() is None
        report = {
            **machine(),
            "prometheus": subprocess.run(
                [prom.ensure_binary(), "--version"], capture_output=True, text=True
            ).stdout.splitlines()[0],
            "screenshot": str(png.relative_to(REPO)),
            "png_bytes": png.stat().st_size,
            "job_still_training_at_shot": still_training,
            "prometheus_loss_values": sorted({float(v) for s in held for _, v in s["values"]}, reverse=True),
            "metrics_jsonl_losses": logged_losses(run_dir),
        }
        job.wait(timeout=900)
        report["job_returncode"] = job.returncode
        (RESULTS / "dashboard_screenshot_cpu.json").write_text(json.dumps(report, indent=2))
        print(json.dumps(report, indent=2))
    finally:
        if job is not None and job.poll() is None:
            job.terminate()
        if server is not None:
            server.stop()
        stop_group(head)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
