import subprocess
import sys


def test_import_does_not_import_torch():
    code = "import sys, fastllm, fastllm._core; assert 'torch' not in sys.modules; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"
