"""Golden order: the batches of five jobs (tools/batch_digest.py) are those of the commit that
recorded tools/batch_digests.json. A change that alters the data order fails here, so it is
made on purpose (then record the digests again with ``--save``) and said in its notes."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_batches_are_the_recorded_ones():
    tool = os.path.join(ROOT, "tools", "batch_digest.py")
    done = subprocess.run([sys.executable, tool, "--check", os.path.join(ROOT, "tools", "batch_digests.json")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "all 5 jobs give the same batches" in done.stderr
