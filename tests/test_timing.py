"""tilec.timing.SmClock: the SM and memory clocks sampled with nvidia-smi while a block runs, and no
error when the tool is missing or prints nonsense (CPU machines, CI)."""
import os
import stat
import time

from tilec.timing import SmClock


def fake_smi(tmp_path, body: str):
    exe = tmp_path / "nvidia-smi"
    exe.write_text(f"#!/bin/sh\n{body}\n")
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return str(tmp_path)


def test_median_of_the_samples(tmp_path, monkeypatch):
    # the fake prints 1980 on odd calls and 1755 on even ones (its own call counter)
    counter = tmp_path / "n"
    body = (f'n=$(cat {counter} 2>/dev/null || echo 0); n=$((n + 1)); echo $n > {counter}; '
            'if [ $((n % 2)) -eq 1 ]; then echo 1980; else echo 1755; fi')
    monkeypatch.setenv("PATH", fake_smi(tmp_path, body) + os.pathsep + os.environ["PATH"])
    with SmClock(period_s=0.02) as clk:
        time.sleep(0.3)
    assert len(clk.samples) >= 3 and set(clk.samples) <= {1980, 1755}
    assert clk.samples[0] == 1980 and clk.mhz in (1755, 1867, 1980)
    assert clk.mem_mhz is None  # a tool that prints one value: no memory clock


def test_memory_clock_is_the_second_value(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", fake_smi(tmp_path, "echo '1980, 3201'") + os.pathsep + os.environ["PATH"])
    with SmClock(period_s=0.02) as clk:
        time.sleep(0.1)
    assert clk.mhz == 1980 and clk.mem_mhz == 3201
    warned = "echo 'WARNING: infoROM is corrupted at gpu 00000000:17:00.0'; echo '1755, 2619'"
    monkeypatch.setenv("PATH", fake_smi(tmp_path, warned) + os.pathsep + os.environ["PATH"])
    with SmClock(period_s=0.02) as clk:  # a reviewer's case: the first line is not the values
        time.sleep(0.05)
    assert clk.mhz == 1755 and clk.mem_mhz == 2619
    monkeypatch.setenv("PATH", fake_smi(tmp_path, "echo '1980, [N/A]'") + os.pathsep + os.environ["PATH"])
    with SmClock(period_s=0.02) as clk:
        time.sleep(0.05)
    assert clk.mhz == 1980 and clk.mem_mhz is None


def test_missing_or_broken_tool_gives_none(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with SmClock() as clk:
        pass
    assert clk.mhz is None and clk.samples == [] and clk.mem_mhz is None
    monkeypatch.setenv("PATH", fake_smi(tmp_path, "echo '[N/A]'; exit 3"))
    with SmClock(period_s=0.01) as clk:
        time.sleep(0.05)
    assert clk.mhz is None
