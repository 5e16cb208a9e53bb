"""Test-wide settings: CPU platform (libtpu is installed for AOT compiles, not as a backend)."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
