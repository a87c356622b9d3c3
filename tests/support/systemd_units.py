"""The unit files checked by systemd-analyze: shared by the tests of the daemon's units and the HTTP
front's."""
import shutil
import subprocess

from daemon_fixtures import REPO

SYSTEMD_ANALYZE = shutil.which("systemd-analyze")


def check_units(tmp_path, socket_unit: str, service_unit: str) -> None:
    """systemd-analyze verifies the pair cleanly and rates the service at most 2.0 (SAFE)."""
    for name in (service_unit, socket_unit):
        text = (REPO / "systemd" / name).read_text()
        (tmp_path / name).write_text(text.replace("/usr/bin/llmd", str(REPO / ".venv" / "bin" / "llmd")))
    out = subprocess.run([SYSTEMD_ANALYZE, "verify", "--man=no", str(tmp_path / socket_unit),
                          str(tmp_path / service_unit)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stderr.strip() == "", out.stderr
    sec = subprocess.run([SYSTEMD_ANALYZE, "security", "--offline=yes", str(tmp_path / service_unit)],
                         capture_output=True, text=True, timeout=60)
    line = next(l for l in sec.stdout.splitlines() if "Overall exposure level" in l)
    assert float(line.split(":")[1].split()[0]) <= 2.0, line
