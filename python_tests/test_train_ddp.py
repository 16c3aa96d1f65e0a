"""Data-parallel training: ``python -m torch.distributed.run --nproc-per-node 2 -m
dspark_ops.train`` (gloo on CPU) ends where one process with the same global batch ends, within
float tolerance. DeepSpec's normalisation makes them equal: each rank divides by the denominators
summed over ranks and multiplies by the world size, and DDP averages the gradients."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from cases.training import read_metrics, save_target, train_args, write_greedy_data

from dspark_ops.models import load_state_dict_file  # noqa: E402
from dspark_ops.train.trainer import main  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed missing")
def test_two_ranks_equal_one_process(tmp_path):
    target = save_target(str(tmp_path / "target"))
    data = write_greedy_data(target, str(tmp_path / "data.jsonl"), count=12, new_tokens=24)
    common = ["--max-steps", "3", "--lr", "3e-3", "--markov-rank", "16",
              "--calibration-samples", "0", "--seed", "3"]
    ddp_out, one_out = str(tmp_path / "ddp"), str(tmp_path / "one")
    # 2 ranks x 128 padded tokens make the same global micro-batches as 1 process x 256
    argv = train_args(target, data, ddp_out, *common)
    argv[argv.index("--batch-tokens") + 1] = "128"
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc-per-node", "2", "-m", "dspark_ops.train", *argv],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and both ranks
        stdout, stderr = proc.communicate()
        pytest.fail("torchrun timed out:\n" + stdout[-2000:] + stderr[-2000:])
    assert proc.returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert "x 2 rank(s)" in stdout
    assert stdout.count("checkpoint:") == 1  # rank 0 alone writes and reports
    torch.set_num_threads(1)
    main(train_args(target, data, one_out, *common))
    a = load_state_dict_file(os.path.join(ddp_out, "step_3", "model.safetensors"))
    b = load_state_dict_file(os.path.join(one_out, "step_3", "model.safetensors"))
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-4, msg=name)
    rows_ddp, rows_one = read_metrics(ddp_out), read_metrics(one_out)
    assert len(rows_ddp) == len(rows_one) == 3
    for x, y in zip(rows_ddp, rows_one):
        for key in ("loss", "ce", "l1", "confidence", "tau_probabilistic", "accept_rate@0",
                    "grad_norm"):
            assert x[key] == pytest.approx(y[key], rel=1e-4, abs=1e-5), key
        assert x["tokens"] == y["tokens"]
    state = torch.load(os.path.join(ddp_out, "step_3", "training_state.pt"), weights_only=False)
    assert state["world_size"] == 2 and state["schedule"]["world_size"] == 2
    assert json.load(open(os.path.join(ddp_out, "step_3", "config.json")))["block_size"] == 4
