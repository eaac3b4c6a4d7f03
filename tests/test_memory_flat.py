"""Many analyses in one process keep memory flat (a pytest plugin over a large suite, a compile backend in a
training job). Runs in a fresh subprocess so the rest of the suite does not move its RSS."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

# RSS after gc.collect() from /proc/self/statm, and the ShapeEnvs still alive, after 20 and after 100 analyses
_SCRIPT = textwrap.dedent("""
    import gc, json, os, sys
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from boomfx.analysis.analysis import analyze
    def sample():
        gc.collect()
        rss = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20
        return rss, sum(isinstance(o, ShapeEnv) for o in gc.get_objects())
    out = {}
    for i in range(1, 101):
        analyze(sys.argv[1], device="cpu", db="none", train=True, batch=8)
        if i in (20, 100):
            out[i] = sample()
    print(json.dumps(out))
""")

# Before the fix: +0.23 MiB per analysis (about 18 MiB over these 80) and two more ShapeEnvs per analysis
GROWTH_LIMIT_MIB = 4.0


def test_rss_after_100_training_analyses_is_within_a_few_mib_of_after_20() -> None:
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(EXAMPLES / "mlp.pt2")], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    samples = json.loads(proc.stdout.strip().splitlines()[-1])
    (rss20, envs20), (rss100, envs100) = samples["20"], samples["100"]
    assert rss100 - rss20 < GROWTH_LIMIT_MIB
    assert envs100 <= envs20 <= 4          # nothing pins the ShapeEnv of each load and each training trace
