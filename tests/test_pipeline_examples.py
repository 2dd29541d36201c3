"""The scheduler examples in examples/ stay valid: files parse, and every `distill run` they contain loads."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from distill.config import load_config

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _distill_args(command: str) -> tuple[str, list[str]]:
    """(config path, overrides) of the `distill run` inside a shell command line, shell values filled in."""
    command = command.replace("\\%", "%").replace("%%", "%")
    command = re.sub(r"\$\(date [^)]*\)", "2026-12-02", command)
    values = {"CONFIG": "configs/smollm2-sharegpt.yaml", "RUN_NAME": "slurm-123"}  # others: counts
    command = re.sub(r'"?\$\{?(\w+)(:-[^}]*)?\}?"?', lambda m: values.get(m.group(1), "4"), command)
    words = shlex.split(command.replace("\\\n", " "))
    wrapper = [i for i, w in enumerate(words) if w.endswith("nightly.sh")]
    if wrapper:  # nightly.sh STATE_FILE DISTILL [distill run arguments...]
        i = wrapper[0] + 2
    else:
        i = words.index("run")
        assert words[i - 1].endswith("distill")
    assert words[i].endswith("distill") or words[i] == "run"
    assert words[i + 1] == "-c"
    config = words[i + 2]
    overrides = [w for w in words[i + 3 :] if "=" in w and not w.startswith((">", "&"))]
    return config, overrides


def _check_loads(command: str) -> None:
    config, overrides = _distill_args(command)
    shipped = Path(__file__).resolve().parents[1] / "configs" / Path(config).name
    load_config(shipped, overrides)  # raises ConfigError on an unknown key or a bad value


def _cron_command() -> str:
    lines = [
        ln
        for ln in (EXAMPLES / "cron" / "distill.cron").read_text().splitlines()
        if ln and not ln.startswith("#") and "=" not in ln.split()[0]
    ]
    assert len(lines) == 1 and len(lines[0].split()[:5]) == 5
    return lines[0].split(None, 5)[5]


def test_cron_line_loads():
    _check_loads(_cron_command())


@pytest.mark.skipif(not (shutil.which("bash") and shutil.which("flock")), reason="needs bash and flock")
def test_cron_line_resumes_an_unfinished_run_and_starts_fresh_after_it_ends(tmp_path):
    """What the file's comment promises, with a fake `distill` (exit code chosen per night) and a fake `date`."""
    command = (
        _cron_command()
        .replace("\\%", "%")
        .replace("cd /opt/distill", f"cd {tmp_path}")
        .replace("/tmp/distill.lock", str(tmp_path / "lock"))
    )
    (tmp_path / "logs").mkdir()
    (tmp_path / "examples").mkdir()
    shutil.copy2(EXAMPLES / "nightly.sh", tmp_path / "examples" / "nightly.sh")
    fake_bin, venv_bin = tmp_path / "fake_bin", tmp_path / ".venv" / "bin"
    fake_bin.mkdir()
    venv_bin.mkdir(parents=True)
    (venv_bin / "distill").write_text('#!/bin/sh\necho "$@" >> calls.txt\nexit "$(cat rc)"\n')
    (fake_bin / "date").write_text("#!/bin/sh\ncat today\n")
    for exe in (venv_bin / "distill", fake_bin / "date"):
        exe.chmod(0o755)
    env = {"PATH": f"{fake_bin}:/usr/bin:/bin"}
    nights = [("2026-12-01", 130), ("2026-12-02", 1), ("2026-12-03", 0), ("2026-12-04", 2), ("2026-12-05", 0)]
    for day, rc in nights:
        (tmp_path / "today").write_text(day + "\n")
        (tmp_path / "rc").write_text(str(rc))
        subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, check=False)
    calls = (tmp_path / "calls.txt").read_text().splitlines()
    names = [next(w for w in c.split() if w.startswith("run.name=")) for c in calls]
    # interrupted (130) and failed (1) nights are continued; done (0) and refused (2) ones are not
    assert names == [f"run.name=nightly-{d}" for d in ("2026-12-01",) * 3 + ("2026-12-04", "2026-12-05")]
    assert all(c.startswith("run -c configs/smollm2-sharegpt.yaml") for c in calls)
    assert not (tmp_path / "logs" / "nightly-run-name").exists()


def test_systemd_units():
    service = (EXAMPLES / "systemd" / "distill.service").read_text()
    exec_start = next(ln for ln in service.splitlines() if ln.startswith("ExecStart="))
    _check_loads(exec_start.removeprefix("ExecStart="))
    # The run name outlives a restart after midnight: nightly.sh keeps it in the service's state directory.
    assert "StateDirectory=distill" in service and " /var/lib/distill/nightly-run-name " in exec_start
    assert "RestartPreventExitStatus=2" in service and "KillSignal=SIGTERM" in service
    timer = (EXAMPLES / "systemd" / "distill.timer").read_text()
    assert "OnCalendar=" in timer and "Persistent=true" in timer
    if shutil.which("systemd-analyze"):
        out = subprocess.run(
            ["systemd-analyze", "verify", str(EXAMPLES / "systemd" / "distill.timer")],
            capture_output=True,
            text=True,
        )
        assert "rror" not in out.stderr, out.stderr


def test_slurm_script():
    script = (EXAMPLES / "slurm" / "distill.sbatch").read_text()
    subprocess.run(["bash", "-n", str(EXAMPLES / "slurm" / "distill.sbatch")], check=True)
    assert "#SBATCH --requeue" in script and "scontrol requeue" in script and "trap requeue USR1" in script
    srun = script[script.index("srun ") : script.index("&\n")]
    _check_loads(srun)


def test_kubernetes_cronjob():
    yaml = pytest.importorskip("yaml")
    docs = list(yaml.safe_load_all((EXAMPLES / "kubernetes" / "cronjob.yaml").read_text()))
    cron = next(d for d in docs if d["kind"] == "CronJob")
    job = cron["spec"]["jobTemplate"]["spec"]
    pod = job["template"]["spec"]
    assert cron["spec"]["concurrencyPolicy"] == "Forbid" and pod["restartPolicy"] == "Never"
    assert job["podFailurePolicy"]["rules"][0]["onExitCodes"]["values"] == [2]
    args = pod["containers"][0]["args"][0]
    _check_loads(args)
    # nightly.sh comes from the ConfigMap and keeps the run name on the volume, which retries share.
    assert "/config/nightly.sh /work/state/" in args
    assert any(m["mountPath"] == "/work" for m in pod["containers"][0]["volumeMounts"])


def test_readme_covers_every_example():
    readme = (EXAMPLES / "README.md").read_text()
    for f in (
        "cron/distill.cron",
        "systemd/distill.service",
        "systemd/distill.timer",
        "slurm/distill.sbatch",
        "kubernetes/cronjob.yaml",
        "nightly.sh",
    ):
        assert (EXAMPLES / f).is_file()
        assert f in readme


def _fake_distill(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A `distill` that records its arguments and exits with the code in ./rc, and a `date` that prints ./today."""
    fake_bin = tmp_path / "fake_bin"
    fake_bin.mkdir()
    (fake_bin / "distill").write_text('#!/bin/sh\necho "$@" >> calls.txt\nexit "$(cat rc)"\n')
    (fake_bin / "date").write_text("#!/bin/sh\ncat today\n")
    for exe in fake_bin.iterdir():
        exe.chmod(0o755)
    return fake_bin / "distill", {"PATH": f"{fake_bin}:/usr/bin:/bin"}


def test_nightly_script_resumes_a_run_retried_after_midnight(tmp_path):
    """A run that fails at 23:50 and is retried after midnight (systemd's Restart=, a Job's retry) keeps its
    folder; the state file's missing directory is created; a finished run frees the name."""
    distill, env = _fake_distill(tmp_path)
    state = tmp_path / "state" / "sub" / "nightly-run-name"
    attempts = [("2026-12-01", 1), ("2026-12-02", 130), ("2026-12-02", 0), ("2026-12-02", 0)]
    codes = []
    for day, rc in attempts:
        (tmp_path / "today").write_text(day + "\n")
        (tmp_path / "rc").write_text(str(rc))
        args = [
            "sh",
            str(EXAMPLES / "nightly.sh"),
            str(state),
            str(distill),
            "-c",
            "c.yaml",
            "publish.name=x",
        ]
        codes.append(subprocess.run(args, cwd=tmp_path, env=env).returncode)
        assert state.exists() == (rc in (1, 130))
    assert codes == [rc for _, rc in attempts]  # the scheduler sees distill's own exit code
    calls = (tmp_path / "calls.txt").read_text().splitlines()
    assert calls[:3] == ["run -c c.yaml publish.name=x run.name=nightly-2026-12-01"] * 3
    assert calls[3] == "run -c c.yaml publish.name=x run.name=nightly-2026-12-02"
    assert not list(state.parent.glob("*.tmp"))


def test_nightly_script_without_arguments_is_a_usage_error(tmp_path):
    out = subprocess.run(["sh", str(EXAMPLES / "nightly.sh")], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 2 and "usage:" in out.stderr
