"""harness.servers: targets' commands and not-run-here records, the BLAS preload, install stamps, starting a server.

Nothing here installs a peer or starts a server; EXP-009's runs do.
"""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from harness.servers import blas, cache_hits, processes, venvs
from harness.servers import targets as t

MODEL = Path("/models/smollm2-f32")
BLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblasp-r0.3.21.so"


def _launch(target: t.ServerTarget, tmp_path: Path, python: Path = Path("/v/bin/python"), **settings) -> t.Launch:
    return t.Launch(python=python, model_dir=MODEL, model_id="smollm2-135m", port=8123, workdir=tmp_path,
                    settings=target.settings(**settings))


def test_every_runnable_command_binds_localhost_and_the_port(tmp_path):
    for target in t.runnable_targets("Linux"):
        cmd = target.command(_launch(target, tmp_path))
        assert cmd[cmd.index("--host") + 1] == "127.0.0.1"
        assert cmd[cmd.index("--port") + 1] == "8123"
        assert str(MODEL) in cmd


def test_semantic_command_and_its_optional_budgets(tmp_path):
    ours = t.TARGETS["semantic"]
    assert ours.command(_launch(ours, tmp_path)) == [
        "/v/bin/python", "-m", "semantic.serve", "--model", str(MODEL), "--model-id", "smollm2-135m",
        "--host", "127.0.0.1", "--port", "8123", "--cache-dir", str(tmp_path / "cache")]
    assert ours.command(_launch(ours, tmp_path, ram_mb=512))[-2:] == ["--ram-mb", "512"]
    assert ours.command(_launch(ours, tmp_path, echo_history=False))[-1] == "--no-echo-history"
    assert "--no-echo-history" not in ours.command(_launch(ours, tmp_path, echo_history=True))
    assert ours.request_model(MODEL, "smollm2-135m") == "smollm2-135m"
    assert ours.cache_key_field == "prompt_cache_key"   # without it nothing outlives a restart


def test_mlx_lm_cache_size_keeps_its_own_default_and_takes_a_matched_figure(tmp_path):
    peer = t.TARGETS["mlx_lm.server"]
    def size(cmd):
        return cmd[cmd.index("--prompt-cache-size") + 1]
    assert "--prompt-cache-size" not in peer.command(_launch(peer, tmp_path))  # mlx-lm's own 10
    assert size(peer.command(_launch(peer, tmp_path, prompt_cache_size=64))) == "64"
    assert peer.request_model(MODEL, "x") == "default_model"
    with pytest.raises(ValueError, match="prompt_cache_size"):
        peer.settings(prompt_cache_entries=64)


def test_mlx_vlm_apc_env_and_model_name(tmp_path):
    peer = t.TARGETS["mlx-vlm"]
    launch = _launch(peer, tmp_path)
    assert peer.env(launch) == {"APC_ENABLED": "1", "APC_DISK_PATH": str(tmp_path / "apc"), "APC_BLOCK_SIZE": "256"}
    assert peer.env(_launch(peer, tmp_path, apc_memory_max_gb=2))["APC_MEMORY_MAX_GB"] == "2"
    # its request's model is a path it loads: anything but the --model string reloads
    assert peer.request_model(MODEL, "x") == str(MODEL)


def test_vllm_mlx_runs_its_console_script_with_home_in_the_workdir(tmp_path):
    peer = t.TARGETS["vllm-mlx"]
    launch = _launch(peer, tmp_path)
    cmd = peer.command(launch)
    assert cmd[:3] == ["/v/bin/vllm-mlx", "serve", str(MODEL)]
    assert cmd[cmd.index("--ssd-cache-dir") + 1] == str(tmp_path / "ssd")
    assert cmd[cmd.index("--ssd-cache-max-gb") + 1] == "4"
    assert "--continuous-batching" in cmd
    assert peer.env(launch) == {"HOME": str(tmp_path / "home")}
    assert peer.install[0] == ("--no-deps", "vllm-mlx==0.6.0")
    assert peer.request_model(MODEL, "x") == str(MODEL)


def test_peers_get_ours_blas_as_ld_preload_and_ours_loads_it_itself(tmp_path):
    base = {"PATH": "/usr/bin", "SEMANTIC_BLAS": "/somewhere/else.so", "VIRTUAL_ENV": "/old"}
    for target in t.runnable_targets("Linux"):
        env = blas.server_env(target, _launch(target, tmp_path), BLAS, base=base)
        assert "VIRTUAL_ENV" not in env and env["PATH"].startswith("/v/bin")
        if target.loads_blas_itself:
            assert env["SEMANTIC_BLAS"] == "auto" and "LD_PRELOAD" not in env
        else:
            assert env["LD_PRELOAD"] == BLAS and "SEMANTIC_BLAS" not in env
    ours, peer = t.TARGETS["semantic"], t.TARGETS["mlx_lm.server"]
    # no OpenBLAS: everyone stays on MLX's bundled BLAS
    assert blas.server_env(ours, _launch(ours, tmp_path), None, base=base)["SEMANTIC_BLAS"] == "off"
    assert "LD_PRELOAD" not in blas.server_env(peer, _launch(peer, tmp_path), None, base=base)
    # a preload already there is kept, after ours
    kept = blas.server_env(peer, _launch(peer, tmp_path), BLAS, base={**base, "LD_PRELOAD": "/x.so"})
    assert kept["LD_PRELOAD"] == f"{BLAS}:/x.so"


@pytest.mark.skipif(platform.system() != "Linux", reason="/proc and the OpenBLAS preload are Linux-only")
def test_blas_library_is_semantic_blas_choice_and_a_preloaded_child_maps_it():
    path = blas.blas_library()
    if path is None:
        pytest.skip("no system OpenBLAS here")
    assert Path(path).is_file() and os.path.realpath(path) == path
    child = subprocess.Popen([sys.executable, "-c", "import sys; print('up', flush=True); sys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, env={**os.environ, "LD_PRELOAD": path})
    try:
        assert child.stdout.readline() == b"up\n"   # exec'd: its maps are the new program's
        mapping = blas.blas_of(child.pid)
        assert mapping.preload == path and mapping.uses(path) and path in mapping.mapped
    finally:
        child.communicate(b"")
    assert blas.blas_of(child.pid).mapped == ()   # gone: nothing to read


def _recording_pip(log: Path) -> list[str]:
    # A no-op pip that only records its arguments: the stamp logic is what is under test, and a real
    # install needs the network mirror and minutes.
    return [sys.executable, "-c", f"import sys; open({str(log)!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')"]


def test_ensure_venv_runs_the_recipe_once_and_again_only_when_it_changes(tmp_path):
    calls = tmp_path / "pip-calls.txt"
    fake = t.ServerTarget(name="fake", venv="fake", install=(("pkg==1.0",), ("--no-deps", "other==2")),
                          command=None, env=lambda l: {}, health_path="/health", model_name="m",
                          cached_from="none")
    first = venvs.ensure_venv(fake, tmp_path, pip=_recording_pip(calls))
    assert first.installed_now and first.python == tmp_path / ".peers" / "fake" / "bin" / "python"
    assert calls.read_text().splitlines() == ["install pkg==1.0", "install --no-deps other==2"]
    stamp = json.loads((tmp_path / ".peers" / "fake" / venvs.STAMP).read_text())
    assert stamp["recipe_sha256"] == venvs.recipe_hash(fake) and stamp["versions"] == dict(first.versions)

    again = venvs.ensure_venv(fake, tmp_path, pip=_recording_pip(calls))
    assert not again.installed_now and len(calls.read_text().splitlines()) == 2

    changed = t.ServerTarget(name="fake", venv="fake", install=(("pkg==1.1",),), command=None,
                             env=lambda l: {}, health_path="/health", model_name="m", cached_from="none")
    (tmp_path / ".peers" / "fake" / "leftover").write_text("from the old recipe")
    assert venvs.ensure_venv(changed, tmp_path, pip=_recording_pip(calls)).installed_now
    assert calls.read_text().splitlines()[-1] == "install pkg==1.1"
    assert not (tmp_path / ".peers" / "fake" / "leftover").exists()   # rebuilt from nothing


def test_a_failing_recipe_leaves_no_stamp_and_says_why(tmp_path):
    fake = t.ServerTarget(name="fake", venv="fake", install=(("pkg",),), command=None, env=lambda l: {},
                          health_path="/health", model_name="m", cached_from="none")
    with pytest.raises(venvs.InstallError, match="boom"):
        venvs.ensure_venv(fake, tmp_path, pip=[sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"])
    assert not (tmp_path / ".peers" / "fake" / venvs.STAMP).exists()


def test_records_say_why_they_are_not_run_here_and_start_refuses_them(tmp_path):
    for name in ("omlx", "lmstudio-mlx-engine", "llama.cpp"):
        record = t.TARGETS[name]
        assert not record.runnable_on("Linux") and record.reason.startswith("not run here")
        with pytest.raises(processes.NotRunnableHere, match=name):
            processes.start(record, MODEL, 8123, tmp_path)
    assert "macOS" in t.TARGETS["omlx"].reason and "compiles" in t.TARGETS["llama.cpp"].reason
    assert [x.name for x in t.runnable_targets("Linux")] == ["semantic", "mlx_lm.server", "mlx-vlm", "vllm-mlx"]


def test_cached_tokens_from_usage_or_from_stats_growth():
    usage = {"prompt_tokens": 700, "prompt_tokens_details": {"cached_tokens": 512}}
    assert cache_hits.cached_tokens(t.TARGETS["mlx_lm.server"], usage) == 512
    assert cache_hits.cached_tokens(t.TARGETS["semantic"], {"prompt_tokens": 3}) is None
    before = {"engine_cache": {"hits": 0, "tokens_saved": 0}, "multimodal_kv_cache": {}}
    after = {"engine_cache": {"hits": 1, "tokens_saved": 640}, "multimodal_kv_cache": {}}
    assert cache_hits.cached_tokens(t.TARGETS["vllm-mlx"], usage, before, after) == 640
    assert cache_hits.cached_tokens(t.TARGETS["vllm-mlx"], usage) is None


def test_start_reports_an_early_exit_with_the_log_tail(tmp_path):
    dies = t.ServerTarget(name="dies", venv=None, install=(), env=lambda l: {}, health_path="/health",
                          command=lambda l: [str(l.python), "-c", "print('no such model'); raise SystemExit(2)"],
                          model_name="m", cached_from="none")
    with pytest.raises(processes.ServerStartError, match="(?s)exited 2.*no such model"):
        processes.start(dies, MODEL, processes.free_port(), tmp_path, blas=None, ready_timeout_s=30)


def test_start_waits_for_health_and_stop_sends_the_signal(tmp_path):
    server = ("import http.server, sys\n"
              "class H(http.server.BaseHTTPRequestHandler):\n"
              "    def do_GET(self):\n"
              "        self.send_response(200); self.end_headers(); self.wfile.write(b'ok')\n"
              "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n")
    ok = t.ServerTarget(name="ok", venv=None, install=(), env=lambda l: {}, health_path="/health",
                        command=lambda l: [str(l.python), "-c", server, str(l.port)],
                        model_name="m", cached_from="none")
    running = processes.start(ok, MODEL, processes.free_port(), tmp_path, blas=None, ready_timeout_s=30)
    assert running.start_to_ready_s > 0 and running.rss_bytes() > 1 << 20
    assert running.stop(signal.SIGTERM, timeout_s=10) == -signal.SIGTERM
    assert running.rss_bytes() == 0
