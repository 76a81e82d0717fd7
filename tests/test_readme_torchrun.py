"""The README's training loop under ``torchrun --nproc_per_node 2`` (gloo, CPU), as written.

The corpus block runs once here; the model and loop blocks become ``train.py``, run by a real
torchrun. Both ranks must finish the pass (no rank left waiting in a DDP collective at its
end), save their own loader state, and resume from it exactly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from helpers.s3_server import free_port
from test_docs import ROOT, code_blocks

CHECK = '''
# appended by the test: what each rank did
import json
state = torch.load(f"ckpt-rank{rank}.pt", weights_only=False)["data"]
tail = [b["input_ids"] for b in resumed]
json.dump({"rank": rank, "world": dist.get_world_size(), "steps": loader.step, "saved_at": state["step"],
           "mode": resumed.resume_report.mode, "resumed_batches": len(tail), "loss": loss.item()},
          open(f"result-rank{rank}.json", "w"))
dist.destroy_process_group()
'''


def _training_blocks() -> list[str]:
    section = (ROOT / "README.md").read_text().split("## Training", 1)[1].split("\n## ", 1)[0]
    return [b.code for b in code_blocks(section) if b.lang == "python" and b.skip is None]


def test_readme_training_loop_under_torchrun(tmp_path, monkeypatch):
    corpus, model, loop = _training_blocks()
    monkeypatch.chdir(tmp_path)
    exec(compile(corpus, "README.md:corpus", "exec"), {"__name__": "__readme__"})
    (tmp_path / "train.py").write_text("\n\n".join([model, loop, CHECK]))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", "train.py"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = [json.loads((tmp_path / f"result-rank{r}.json").read_text()) for r in range(2)]
    steps = results[0]["steps"]  # after the pass: the first step of the next one
    assert steps >= 4
    for r, result in enumerate(results):
        assert result["rank"] == r and result["world"] == 2
        assert result["steps"] == steps  # the whole pass, on both ranks
        assert result["saved_at"] == steps // 2 and result["mode"] == "exact"
        assert result["resumed_batches"] == steps - steps // 2
    assert "exact" in proc.stdout
