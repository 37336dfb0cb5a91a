"""An incomplete PrivateUse1 backend for tests/test_check.py: only what torch's Python helpers set
up (a name, generated methods, a dummy device module, hooks and guard), no allocator, no kernels."""
import torch

torch.utils.backend_registration._setup_privateuseone_for_python_backend("fakedev")
