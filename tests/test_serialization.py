"""torch.save / torch.load of openreg tensors, models and backend metadata."""

import io
import os
import subprocess
import sys
import textwrap

import pytest
import torch


def roundtrip(obj, **load_kwargs):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, **load_kwargs)


def test_tensor_comes_back_on_its_device_with_its_values(device):
    t = torch.randn(3, 4).to(device)
    loaded = roundtrip(t)
    assert loaded.device == device
    torch.testing.assert_close(loaded.cpu(), t.cpu(), rtol=0, atol=0)
    assert loaded.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int64, torch.bool, torch.complex64])
def test_dtypes_roundtrip(dtype):
    t = torch.randn(5).to(dtype).to("openreg:1")
    loaded = roundtrip(t)
    assert loaded.dtype == dtype and loaded.device == torch.device("openreg:1")
    assert torch.equal(loaded.cpu(), t.cpu())


def test_save_on_device_0_load_on_device_1_and_on_cpu():
    t = torch.arange(12.0).view(3, 4).to("openreg:0")
    on_1 = roundtrip(t, map_location="openreg:1")
    on_cpu = roundtrip(t, map_location="cpu")
    assert on_1.device == torch.device("openreg:1")
    assert on_cpu.device == torch.device("cpu")
    assert torch.equal(on_1.cpu(), t.cpu()) and torch.equal(on_cpu, t.cpu())


def test_map_location_variants():
    t = torch.arange(4.0).to("openreg:0")
    assert roundtrip(t, map_location=torch.device("openreg:1")).device == torch.device("openreg:1")
    assert roundtrip(t, map_location={"openreg:0": "openreg:1"}).device == torch.device("openreg:1")
    assert roundtrip(t, map_location={"openreg:0": "cpu"}).device == torch.device("cpu")
    # A callable receives the CPU-restored storage and its saved location.
    seen = []

    def to_cpu(storage, location):
        seen.append(location)
        return storage

    assert roundtrip(t, map_location=to_cpu).device == torch.device("cpu")
    assert seen == ["openreg:0"]
    # CPU checkpoints load onto the device.
    assert roundtrip(torch.arange(3), map_location="openreg:1").device == torch.device("openreg:1")


def test_views_keep_sharing_their_storage_after_load(device):
    base = torch.arange(10.0).to(device)
    loaded = roundtrip({"base": base, "view": base[2:5]})
    assert loaded["view"].untyped_storage().data_ptr() == loaded["base"].untyped_storage().data_ptr()
    loaded["base"][3] = -1.0
    assert loaded["view"][1].item() == -1.0


def test_non_contiguous_and_offset_tensors(device):
    t = torch.arange(24.0).view(4, 6).to(device).t()[1:, ::2]
    loaded = roundtrip(t)
    assert loaded.stride() == t.stride() and loaded.storage_offset() == t.storage_offset()
    assert torch.equal(loaded.cpu(), t.cpu())


def test_whole_model_and_state_dict_move_between_devices():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    model = model.to("openreg:0")
    model(torch.randn(5, 4).to("openreg:0"))  # update BatchNorm's running statistics
    state = roundtrip(model.state_dict(), map_location="openreg:1")
    assert all(v.device == torch.device("openreg:1") for v in state.values())
    whole = roundtrip(model, map_location="openreg:1", weights_only=False)
    x = torch.randn(3, 4)
    model.eval(), whole.eval()
    assert next(whole.parameters()).device == torch.device("openreg:1")
    torch.testing.assert_close(whole(x.to("openreg:1")).cpu(), model(x.to("openreg:0")).cpu())
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2)).eval()
    fresh.load_state_dict(roundtrip(model.state_dict(), map_location="cpu"))
    torch.testing.assert_close(fresh(x), model(x.to("openreg:0")).cpu())


def test_optimizer_state_roundtrip_resumes_training(device):
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 3).to(device), torch.randn(8, 1).to(device)
    for _ in range(2):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    ckpt = roundtrip({"model": model.state_dict(), "opt": opt.state_dict()})
    assert ckpt["opt"]["state"][0]["exp_avg"].device == device
    clone = torch.nn.Linear(3, 1).to(device)
    clone.load_state_dict(ckpt["model"])
    clone_opt = torch.optim.Adam(clone.parameters(), lr=0.1)
    clone_opt.load_state_dict(ckpt["opt"])
    for m, o in ((model, opt), (clone, clone_opt)):
        o.zero_grad()
        torch.nn.functional.mse_loss(m(x), y).backward()
        o.step()
    torch.testing.assert_close(clone.weight.cpu(), model.weight.cpu())


def test_file_on_disk_and_weights_only(tmp_path, device):
    path = tmp_path / "ckpt.pt"
    torch.save({"w": torch.ones(3).to(device), "step": 7}, path)
    loaded = torch.load(path, weights_only=True)
    assert loaded["step"] == 7 and loaded["w"].device == device


def test_loading_onto_a_missing_device_index_is_a_clear_error():
    t = torch.arange(3.0).to("openreg:1")
    with pytest.raises(RuntimeError, match=r"(?i)openreg device 5 .*device_count\(\) is 2"):
        roundtrip(t, map_location="openreg:5")


def test_checkpoint_from_device_1_in_a_process_with_one_device(tmp_path):
    path = tmp_path / "on_device_1.pt"
    torch.save(torch.arange(3.0).to("openreg:1"), path)
    code = textwrap.dedent(
        f"""
        import torch
        assert torch.openreg.device_count() == 1
        try:
            torch.load({str(path)!r})
        except RuntimeError as e:
            print("ERROR:", e)
        print(torch.load({str(path)!r}, map_location="openreg:0"))
        """
    )
    env = dict(os.environ, OPENREG_DEVICE_COUNT="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ERROR:" in out.stdout and "device 1" in out.stdout.lower()
    assert "tensor([0., 1., 2.], device='openreg:0')" in out.stdout


# --- backend metadata (c10::BackendMeta, csrc/adapters/serialization.cpp) -----------------------


def test_backend_metadata_is_kept_by_the_tensor_and_its_shallow_copies(device):
    t = torch.arange(4.0).to(device)
    assert torch._utils.get_tensor_metadata(t) == {}
    torch._utils.set_tensor_metadata(t, {"openreg_blocked_layout": True, "openreg_pinned_hint": False})
    expected = {"openreg_blocked_layout": True, "openreg_pinned_hint": False}
    assert torch._utils.get_tensor_metadata(t) == expected
    assert torch._utils.get_tensor_metadata(t.detach()) == expected
    torch._utils.set_tensor_metadata(t, {"openreg_pinned_hint": True})  # updates, keeps the rest
    assert torch._utils.get_tensor_metadata(t) == {"openreg_blocked_layout": True, "openreg_pinned_hint": True}
    # New tensors (results, views) have their own TensorImpl and no metadata.
    assert torch._utils.get_tensor_metadata(t + 1) == {}


def test_backend_metadata_survives_save_and_load(device):
    t = torch.arange(4.0).to(device)
    torch._utils.set_tensor_metadata(t, {"openreg_blocked_layout": True})
    assert torch._utils.get_tensor_metadata(roundtrip(t)) == {"openreg_blocked_layout": True}
    other = "openreg:1" if device.index == 0 else "openreg:0"
    assert torch._utils.get_tensor_metadata(roundtrip(t, map_location=other)) == {"openreg_blocked_layout": True}
    # The CPU has no serializer for backend metadata: loading there drops it, as for CUDA.
    assert torch._utils.get_tensor_metadata(roundtrip(t, map_location="cpu")) == {}


def test_conj_bit_and_backend_metadata_together(device):
    z = torch.tensor([1 + 2j, 3 - 1j]).to(device).conj()
    torch._utils.set_tensor_metadata(z, {"openreg_blocked_layout": True})
    assert torch._utils.get_tensor_metadata(z) == {"conj": True, "openreg_blocked_layout": True}
    loaded = roundtrip(z)
    assert loaded.is_conj()
    assert torch.equal(loaded.cpu(), z.cpu())
