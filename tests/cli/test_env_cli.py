"""``gmc env``: the lines and the JSON object of versions, host, gmc's CPU kernel, CUDA and Triton."""
import json

import torch
from conftest import invoke_gmc


def test_env_prints_its_lines():
    result = invoke_gmc("env")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].startswith("versions: gmc ") and f"torch {torch.__version__}" in lines[0]
    assert [line.split(":")[0] for line in lines[1:]] == ["python", "cpu", "gmc C++ CPU kernel", "cuda", "triton"]


def test_env_json_has_every_key():
    result = invoke_gmc("env", "--json")
    assert result.exit_code == 0, result.output
    found = json.loads(result.stdout)
    assert {"versions", "python", "cpu", "isa", "torch_cpu_capability", "gmc_kernel_march", "cores", "cpu_kernel",
            "cuda", "triton"} <= set(found)
    assert found["versions"]["torch"] == torch.__version__ and "transformers" in found["versions"]
    assert found["cores"] >= 1 and isinstance(found["isa"], list)
    assert set(found["cpu_kernel"]) == {"loads", "backend"} and found["cpu_kernel"]["backend"]
    assert found["cuda"]["available"] == torch.cuda.is_available()
    assert len(found["cuda"]["devices"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert set(found["triton"]) == {"installed", "usable", "why"}
