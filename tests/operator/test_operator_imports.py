"""Nothing under operator/ imports JAX, not even through capstan.runtime."""

import subprocess
import sys


def test_operator_imports_no_jax():
    code = (
        "import sys, capstan.operator.main, capstan.operator.crd; "
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'haliax', 'equinox')); "
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
