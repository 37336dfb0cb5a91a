"""Per-device random number generators (csrc/adapters/generator.cpp, torch_openreg/openreg/random.py).

Every random operator on an openreg tensor must draw from that device's generator: seeding it
reproduces the result, seeding anything else (the CPU, the other device) does not change it, and
the CPU generator is never advanced by openreg operators (nor the other way round).
"""

import copy
import pickle
import threading

import pytest
import torch
import torch.distributions as D
import torch.nn.functional as F


def other(device):
    return torch.device("openreg", 1 - device.index)


def _x(dev):
    return torch.linspace(0.05, 0.95, 64, device=dev).reshape(8, 8)


def _qkv(dev):
    return torch.linspace(-1, 1, 2 * 2 * 8 * 4, device=dev).reshape(2, 2, 8, 4)


def _lstm_with_dropout(dev):
    # Weights filled deterministically (a meta module made real), so only dropout draws.
    m = torch.nn.LSTM(4, 4, num_layers=2, dropout=0.5, device="meta").to_empty(device=dev)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.linspace(-0.5, 0.5, p.numel(), device=dev).reshape(p.shape))
    return m.train()(_x(dev).reshape(2, 8, 4))[0].detach()


# name -> (op(device, generator) -> tensor, same numbers as the CPU kernel with the same seed).
# Inputs are built deterministically, so only the operator itself draws random numbers. Operators
# that take no generator argument get generator=None.
OPS = {
    "rand": (lambda d, g: torch.rand(5, 7, device=d, generator=g), True),
    "rand_double": (lambda d, g: torch.rand(33, dtype=torch.float64, device=d, generator=g), True),
    "randn": (lambda d, g: torch.randn(5, 7, device=d, generator=g), True),
    "randn_large": (lambda d, g: torch.randn(100, device=d, generator=g), True),
    "randint": (lambda d, g: torch.randint(3, 1000, (20,), device=d, generator=g), True),
    "randint_high": (lambda d, g: torch.randint(1000, (20,), device=d, generator=g), True),
    "rand_like": (lambda d, g: torch.rand_like(_x(d), generator=g), True),
    "randn_like": (lambda d, g: torch.randn_like(_x(d), generator=g), True),
    "randint_like": (lambda d, g: torch.randint_like(_x(d), 1000), True),
    "randint_like_low": (lambda d, g: torch.randint_like(_x(d), 3, 1000), True),
    "normal_tensor_tensor": (lambda d, g: torch.normal(_x(d), _x(d) + 1, generator=g), True),
    "normal_tensor_float": (lambda d, g: torch.normal(_x(d), 2.0, generator=g), True),
    "normal_float_tensor": (lambda d, g: torch.normal(1.0, _x(d), generator=g), True),
    "normal_float_float": (lambda d, g: torch.normal(1.0, 2.0, (20,), device=d, generator=g), True),
    "normal_": (lambda d, g: torch.empty(20, device=d).normal_(3, 2, generator=g), True),
    "uniform_": (lambda d, g: torch.empty(20, device=d).uniform_(-2, 5, generator=g), True),
    "bernoulli_tensor": (lambda d, g: torch.bernoulli(_x(d), generator=g), True),
    "bernoulli_p": (lambda d, g: torch.bernoulli(_x(d), 0.3, generator=g), True),
    "bernoulli__float": (lambda d, g: torch.empty(64, device=d).bernoulli_(0.4, generator=g), True),
    "bernoulli__tensor": (lambda d, g: torch.empty(8, 8, device=d).bernoulli_(_x(d), generator=g), True),
    "dropout": (lambda d, g: torch.dropout(_x(d), 0.5, True), False),
    "F.dropout": (lambda d, g: F.dropout(_x(d), 0.3, training=True), False),
    "nn.Dropout": (lambda d, g: torch.nn.Dropout(0.5).train()(_x(d)), False),
    "dropout2d": (lambda d, g: F.dropout2d(_x(d).reshape(2, 4, 8, 1), 0.5, training=True), True),
    "alpha_dropout": (lambda d, g: F.alpha_dropout(_x(d), 0.5, training=True), True),
    "feature_alpha_dropout": (
        lambda d, g: F.feature_alpha_dropout(_x(d).reshape(2, 4, 8, 1), 0.5, training=True),
        True,
    ),
    "randperm": (lambda d, g: torch.randperm(50, device=d, generator=g), True),
    "multinomial_replacement": (
        lambda d, g: torch.multinomial(_x(d), 6, replacement=True, generator=g),
        True,
    ),
    "multinomial_no_replacement": (
        lambda d, g: torch.multinomial(_x(d), 6, replacement=False, generator=g),
        True,
    ),
    "exponential_": (lambda d, g: torch.empty(20, device=d).exponential_(2.0, generator=g), True),
    "geometric_": (lambda d, g: torch.empty(20, device=d).geometric_(0.3, generator=g), True),
    "cauchy_": (lambda d, g: torch.empty(20, device=d).cauchy_(generator=g), True),
    "log_normal_": (lambda d, g: torch.empty(20, device=d).log_normal_(generator=g), True),
    "random_": (lambda d, g: torch.empty(20, device=d).random_(generator=g), True),
    "random__to": (lambda d, g: torch.empty(20, device=d).random_(100, generator=g), True),
    "random__from_to": (lambda d, g: torch.empty(20, device=d).random_(3, 100, generator=g), True),
    "random__int64": (
        lambda d, g: torch.empty(20, dtype=torch.int64, device=d).random_(generator=g),
        True,
    ),
    "poisson": (lambda d, g: torch.poisson(_x(d) * 10, generator=g), True),
    "binomial": (lambda d, g: torch.binomial(_x(d) * 0 + 10, _x(d), generator=g), True),
    "_standard_gamma": (lambda d, g: torch._standard_gamma(_x(d) + 1, generator=g), True),
    "_sample_dirichlet": (lambda d, g: torch._sample_dirichlet(_x(d) + 1, generator=g), True),
    "rrelu": (lambda d, g: torch.rrelu(_x(d) - 0.5, training=True, generator=g), True),
    "F.rrelu": (lambda d, g: F.rrelu(_x(d) - 0.5, training=True), True),
    "F.rrelu_": (lambda d, g: F.rrelu_(_x(d) - 0.5, training=True), True),
    "dropout1d": (lambda d, g: F.dropout1d(_x(d).reshape(2, 4, 8), 0.5, training=True), True),
    "dropout3d": (lambda d, g: F.dropout3d(_x(d).reshape(2, 16, 2, 1, 1), 0.5, training=True), True),
    "gumbel_softmax": (lambda d, g: F.gumbel_softmax(_x(d), tau=0.5), True),
    "fractional_max_pool2d": (
        lambda d, g: F.fractional_max_pool2d(
            torch.linspace(0, 1, 4096, device=d).reshape(1, 16, 16, 16), 2, output_size=5
        ),
        True,
    ),
    "init.kaiming_uniform_": (lambda d, g: torch.nn.init.kaiming_uniform_(torch.empty(5, 5, device=d)), True),
    "init.trunc_normal_": (lambda d, g: torch.nn.init.trunc_normal_(torch.empty(5, 5, device=d)), True),
    "init.orthogonal_": (lambda d, g: torch.nn.init.orthogonal_(torch.empty(5, 5, device=d)), True),
    "Gamma.sample": (lambda d, g: D.Gamma(_x(d), 1.0).sample(), True),
    "Beta.sample": (lambda d, g: D.Beta(_x(d), _x(d)).sample(), True),
    "Categorical.sample": (lambda d, g: D.Categorical(_x(d)).sample((3,)), True),
    "rand_float16": (lambda d, g: torch.rand(20, dtype=torch.float16, device=d, generator=g), True),
    "randn_bfloat16": (lambda d, g: torch.randn(20, dtype=torch.bfloat16, device=d, generator=g), True),
    "randn_complex64": (lambda d, g: torch.randn(20, dtype=torch.complex64, device=d, generator=g), True),
    "normal_out": (lambda d, g: torch.normal(_x(d), 1.0, out=torch.empty(8, 8, device=d), generator=g), True),
    "randperm_large": (lambda d, g: torch.randperm(100000, device=d, generator=g), True),
    "lstm_dropout": (lambda d, g: _lstm_with_dropout(d), False),
    "sdpa_dropout": (
        lambda d, g: F.scaled_dot_product_attention(_qkv(d), _qkv(d), _qkv(d), dropout_p=0.5),
        False,
    ),
}
TAKES_GENERATOR = [
    name
    for name in OPS
    if "dropout" not in name.lower()
    and "." not in name
    and name not in ("randint_like", "randint_like_low", "gumbel_softmax", "fractional_max_pool2d")
]


def run(name, dev, gen=None):
    return OPS[name][0](dev, gen).cpu()


def states(device):
    return torch.openreg.get_rng_state(device), torch.openreg.get_rng_state(other(device))


# ---- (a) same seed, same numbers; (b) different seed, different numbers


@pytest.mark.parametrize("name", OPS)
def test_same_seed_same_numbers_other_seed_other_numbers(name, device):
    with torch.openreg.device(device):
        torch.openreg.manual_seed(1234)
        a = run(name, device)
        a2 = run(name, device)  # the state advanced: the next call differs
        torch.openreg.manual_seed(1234)
        b = run(name, device)
        torch.openreg.manual_seed(4321)
        c = run(name, device)
    assert torch.equal(a, b)
    assert not torch.equal(a, a2)
    assert not torch.equal(a, c)


@pytest.mark.parametrize("name", [n for n, (_, cpu_equal) in OPS.items() if cpu_equal])
def test_same_numbers_as_cpu_with_same_seed(name, device):
    # An openreg generator is an mt19937 engine like the CPU's, and the fallback runs the CPU kernel
    # with it: with the same seed, the same numbers come out.
    torch.manual_seed(77)
    expected = run(name, "cpu")
    torch.manual_seed(77)
    actual = run(name, device)
    assert actual.dtype == expected.dtype
    assert torch.equal(actual, expected)


# ---- the operator draws from its device's generator and from nothing else


@pytest.mark.parametrize("name", OPS)
def test_draws_from_device_generator_only(name, device):
    torch.manual_seed(5)
    cpu_before = torch.get_rng_state()
    mine_before, other_before = states(device)
    run(name, device)
    mine_after, other_after = states(device)
    assert not torch.equal(mine_before, mine_after), "the device's generator did not advance"
    assert torch.equal(other_before, other_after), "the other device's generator advanced"
    assert torch.equal(cpu_before, torch.get_rng_state()), "the CPU generator advanced"


@pytest.mark.parametrize("name", OPS)
def test_sequence_unaffected_by_other_device_and_cpu(name, device):
    # (c) devices are independent; (d) the CPU generator is separate.
    torch.openreg.manual_seed_all(11)
    expected = [run(name, device), run(name, device)]
    torch.openreg.manual_seed_all(11)
    first = run(name, device)
    with torch.openreg.device(other(device)):
        torch.openreg.manual_seed(999)  # seeds the other device only
    run(name, other(device))
    torch.default_generator.manual_seed(3)  # seeds the CPU only
    torch.rand(100)
    run(name, "cpu")
    second = run(name, device)
    assert torch.equal(first, expected[0])
    assert torch.equal(second, expected[1])


def test_other_device_and_cpu_leave_the_sequence_alone(device):
    torch.openreg.manual_seed_all(11)
    expected = [torch.rand(10, device=device) for _ in range(3)]
    torch.openreg.manual_seed_all(11)
    got = [torch.rand(10, device=device)]
    with torch.openreg.device(other(device)):
        torch.openreg.manual_seed(999)
        torch.openreg.seed()
    torch.randn(50, device=other(device))
    torch.randn(50)
    torch.empty(10).uniform_()
    got.append(torch.rand(10, device=device))
    torch.Generator().manual_seed(1)
    torch.default_generator.manual_seed(2)  # the CPU's generator only
    got.append(torch.rand(10, device=device))
    for e, g in zip(expected, got):
        assert torch.equal(e.cpu(), g.cpu())


def test_cpu_random_ops_leave_openreg_generators_alone():
    before = torch.openreg.get_rng_state_all()
    torch.rand(10)
    torch.randn(10)
    torch.randperm(10)
    F.dropout(torch.ones(10), 0.5, training=True)
    torch.multinomial(torch.ones(5), 3)
    torch.empty(5).exponential_()
    after = torch.openreg.get_rng_state_all()
    for b, a in zip(before, after):
        assert torch.equal(b, a)


def test_devices_have_separate_default_generators():
    g0, g1 = torch.openreg.default_generators
    assert g0.device == torch.device("openreg:0") and g1.device == torch.device("openreg:1")
    g0.manual_seed(1)
    g1.manual_seed(1)
    a0 = torch.rand(10, device="openreg:0")
    g1.manual_seed(2)
    a1 = torch.rand(10, device="openreg:1")
    g0.manual_seed(1)
    assert torch.equal(torch.rand(10, device="openreg:0").cpu(), a0.cpu())
    assert not torch.equal(a0.cpu(), a1.cpu())
    # The objects are the ones ATen uses: seeding them through torch.openreg reaches the same.
    torch.openreg.manual_seed_all(8)
    assert g0.initial_seed() == 8 and g1.initial_seed() == 8


# ---- (e) state save and restore


def test_get_set_rng_state_reproduces(device):
    torch.openreg.manual_seed_all(3)
    torch.rand(7, device=device)
    torch.randn(3, device=device)  # leaves a cached normal sample in the state on the CPU engine
    state = torch.openreg.get_rng_state(device)
    expected = [torch.randn(5, device=device).cpu(), torch.randperm(9, device=device).cpu()]
    torch.openreg.manual_seed(100)
    torch.openreg.set_rng_state(state, device)
    assert torch.equal(torch.randn(5, device=device).cpu(), expected[0])
    assert torch.equal(torch.randperm(9, device=device).cpu(), expected[1])


def test_get_rng_state_device_forms():
    torch.openreg.manual_seed_all(0)
    torch.rand(3, device="openreg:1")
    s1 = torch.openreg.get_rng_state(1)
    assert torch.equal(torch.openreg.get_rng_state("openreg:1"), s1)
    assert torch.equal(torch.openreg.get_rng_state(torch.device("openreg", 1)), s1)
    assert not torch.equal(torch.openreg.get_rng_state(0), s1)
    with torch.openreg.device(1):
        assert torch.equal(torch.openreg.get_rng_state(), s1)  # default: the current device
    assert torch.equal(torch.openreg.get_rng_state(), torch.openreg.get_rng_state(0))


def test_get_set_rng_state_all():
    torch.openreg.manual_seed_all(21)
    torch.rand(4, device="openreg:1")
    states = torch.openreg.get_rng_state_all()
    assert len(states) == torch.openreg.device_count()
    expected = [torch.rand(6, device=f"openreg:{i}").cpu() for i in range(2)]
    torch.openreg.seed_all()
    torch.openreg.set_rng_state_all(states)
    assert all(torch.equal(torch.rand(6, device=f"openreg:{i}").cpu(), expected[i]) for i in range(2))


def test_returned_state_is_a_copy(device):
    state = torch.openreg.get_rng_state(device)
    kept = state.clone()
    torch.rand(100, device=device)
    assert torch.equal(state, kept)
    state.zero_()  # writing the returned tensor does not change the generator
    assert not torch.equal(torch.openreg.get_rng_state(device), state)


# ---- (f) fork_rng


def test_fork_rng_restores_state(device):
    torch.openreg.manual_seed_all(4)
    before = torch.openreg.get_rng_state_all()
    with torch.random.fork_rng(devices=[0, 1], device_type="openreg"):
        torch.openreg.manual_seed_all(123)
        torch.rand(10, device="openreg:0")
        torch.rand(10, device="openreg:1")
    after = torch.openreg.get_rng_state_all()
    assert all(torch.equal(b, a) for b, a in zip(before, after))
    expected = torch.rand(5, device=device).cpu()
    torch.openreg.set_rng_state_all(before)
    with torch.random.fork_rng(devices=[device.index], device_type="openreg"):
        torch.rand(50, device=device)
    assert torch.equal(torch.rand(5, device=device).cpu(), expected)


def test_fork_rng_only_listed_devices():
    torch.openreg.manual_seed_all(4)
    before = torch.openreg.get_rng_state_all()
    with torch.random.fork_rng(devices=[0], device_type="openreg"):
        torch.rand(10, device="openreg:0")
        torch.rand(10, device="openreg:1")  # device 1 is not forked: it advances for real
    after = torch.openreg.get_rng_state_all()
    assert torch.equal(before[0], after[0])
    assert not torch.equal(before[1], after[1])


def test_fork_rng_disabled_and_default_devices():
    torch.openreg.manual_seed_all(4)
    with torch.random.fork_rng(device_type="openreg", enabled=False):
        torch.rand(10, device="openreg:0")
    assert not torch.equal(torch.openreg.get_rng_state(0), torch.Generator(device="openreg:0").manual_seed(4).get_state())
    before = torch.openreg.get_rng_state_all()
    with pytest.warns(UserWarning, match="fork_rng"):  # all devices, as torch.cuda
        with torch.random.fork_rng(device_type="openreg"):
            torch.rand(10, device="openreg:1")
    assert all(torch.equal(b, a) for b, a in zip(before, torch.openreg.get_rng_state_all()))


# ---- (g) seeding functions behave like torch.cuda's


def test_torch_manual_seed_seeds_openreg():
    torch.manual_seed(42)
    a = [torch.rand(5, device=f"openreg:{i}").cpu() for i in range(2)]
    assert [g.initial_seed() for g in torch.openreg.default_generators] == [42, 42]
    torch.openreg.manual_seed_all(7)
    torch.manual_seed(42)
    b = [torch.rand(5, device=f"openreg:{i}").cpu() for i in range(2)]
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert torch.equal(a[0], a[1])  # same seed, same engine


def test_torch_seed_seeds_openreg():
    s = torch.seed()
    assert torch.initial_seed() == s
    assert [g.initial_seed() for g in torch.openreg.default_generators] == [s, s]


def test_manual_seed_is_current_device_only():
    torch.openreg.manual_seed_all(1)
    with torch.openreg.device(1):
        torch.openreg.manual_seed(9)
        assert torch.openreg.initial_seed() == 9
    assert torch.openreg.initial_seed() == 1  # device 0 is current here
    assert torch.openreg.default_generators[1].initial_seed() == 9
    torch.openreg.manual_seed(2**64 - 1)
    assert torch.openreg.initial_seed() == 2**64 - 1
    torch.openreg.manual_seed(-1)  # negative seeds wrap, as for torch.cuda.manual_seed
    assert torch.openreg.initial_seed() == 2**64 - 1
    with pytest.raises((TypeError, ValueError)):
        torch.openreg.manual_seed("seed")


def test_seed_and_seed_all():
    torch.openreg.manual_seed_all(1)
    with torch.openreg.device(1):
        torch.openreg.seed()
        s1 = torch.openreg.initial_seed()
    assert torch.openreg.default_generators[0].initial_seed() == 1
    assert s1 != 1
    torch.openreg.seed_all()
    seeds = [g.initial_seed() for g in torch.openreg.default_generators]
    assert seeds[0] == seeds[1] and seeds[0] not in (1, s1)
    torch.openreg.seed_all()
    assert torch.openreg.default_generators[0].initial_seed() != seeds[0]


def test_device_module_api_matches_cuda():
    import torch.cuda

    mod = torch.get_device_module("openreg")
    for name in (
        "manual_seed", "manual_seed_all", "seed", "seed_all", "initial_seed", "get_rng_state",
        "set_rng_state", "get_rng_state_all", "set_rng_state_all", "default_generators",
    ):
        assert hasattr(torch.cuda, name) and hasattr(mod, name), name


# ---- (h) explicit generators


@pytest.mark.parametrize("name", TAKES_GENERATOR)
def test_explicit_generator(name, device):
    gen = torch.Generator(device=device)
    assert gen.device == device
    torch.openreg.manual_seed_all(0)
    default_before = states(device)
    gen.manual_seed(31)
    a = run(name, device, gen)
    gen.manual_seed(31)
    b = run(name, device, gen)
    assert torch.equal(a, b)
    # The default generators did not move; the same seed there gives the same numbers.
    assert all(torch.equal(x, y) for x, y in zip(default_before, states(device)))
    with torch.openreg.device(device):
        torch.openreg.manual_seed(31)
    assert torch.equal(run(name, device), a)


@pytest.mark.parametrize("name", TAKES_GENERATOR)
def test_wrong_generator_raises(name, device):
    with pytest.raises(RuntimeError, match="Expected a 'openreg' device type for generator but found 'cpu'"):
        run(name, device, torch.Generator())
    with pytest.raises(RuntimeError, match=f"Expected a generator of {device}"):
        run(name, device, torch.Generator(device=other(device)))
    with pytest.raises(RuntimeError, match="Expected a 'cpu' device type for generator but found 'openreg'"):
        run(name, "cpu", torch.Generator(device=device))


def test_generator_device_default_is_current_device():
    with torch.openreg.device(1):
        assert torch.Generator(device="openreg").device == torch.device("openreg:1")
    assert torch.Generator(device="openreg").device == torch.device("openreg:0")
    with pytest.raises(RuntimeError, match="device index is out of range"):
        torch.Generator(device="openreg:7")


def test_new_generators_start_from_default_seed(device):
    a, b = torch.Generator(device=device), torch.Generator(device=device)
    assert a.initial_seed() == b.initial_seed() == torch.Generator().initial_seed()
    assert torch.equal(torch.rand(5, device=device, generator=a).cpu(),
                       torch.rand(5, device=device, generator=b).cpu())


# ---- (i) offsets


def test_offsets_not_supported(device):
    gen = torch.Generator(device=device)
    for call in (
        lambda: torch.openreg.get_offset(device),
        lambda: torch.openreg.set_offset(0, device),
        gen.get_offset,
        lambda: gen.set_offset(5),
        torch.openreg.default_generators[device.index].get_offset,
    ):
        with pytest.raises(RuntimeError, match="not counter-based.*not supported"):
            call()


def test_pickle_and_deepcopy_of_generator_fail_cleanly(device):
    # torch.Generator.__reduce__ stores the offset of every non-CPU generator, which an openreg
    # generator does not have: the error says so (no crash, no silently wrong copy).
    gen = torch.Generator(device=device)
    for call in (lambda: pickle.dumps(gen), lambda: copy.deepcopy(gen)):
        with pytest.raises(Exception) as info:
            call()
        chain, e = [], info.value
        while e is not None:
            chain.append(str(e))
            e = e.__cause__ or e.__context__
        assert any("get_offset is not supported" in m for m in chain), chain


# ---- (j) state tensors and bad input


def test_state_is_cpu_byte_tensor(device):
    for state in (torch.openreg.get_rng_state(device), torch.Generator(device=device).get_state(),
                  *torch.openreg.get_rng_state_all()):
        assert state.dtype == torch.uint8 and state.device.type == "cpu" and state.dim() == 1
        assert state.numel() == torch.get_rng_state().numel()


def test_set_rng_state_rejects_bad_input(device):
    good = torch.openreg.get_rng_state(device)
    with pytest.raises(TypeError, match="ByteTensor"):
        torch.openreg.set_rng_state(good.float(), device)
    with pytest.raises(TypeError, match="ByteTensor"):
        torch.openreg.set_rng_state(good.to(device), device)
    with pytest.raises(TypeError, match="ByteTensor"):
        torch.openreg.set_rng_state(good.tolist(), device)
    with pytest.raises(RuntimeError, match="size"):
        torch.openreg.set_rng_state(good[:100], device)
    with pytest.raises(RuntimeError, match="device index is out of range"):
        torch.openreg.set_rng_state(good, 5)
    with pytest.raises(RuntimeError, match="device index is out of range"):
        torch.openreg.get_rng_state(5)
    with pytest.raises(ValueError, match="openreg device"):
        torch.openreg.get_rng_state("cpu")
    assert torch.equal(torch.openreg.get_rng_state(device), good)  # unchanged by the failures


def test_set_rng_state_accepts_non_contiguous(device):
    state = torch.openreg.get_rng_state(device)
    expected = torch.rand(5, device=device).cpu()
    doubled = torch.stack([state, torch.zeros_like(state)], 1)
    torch.openreg.set_rng_state(doubled[:, 0], device)
    assert torch.equal(torch.rand(5, device=device).cpu(), expected)


# ---- (k) threads


def test_threads_drawing_from_one_generator_get_whole_chunks(device):
    # Each random operator takes the generator's lock for all its numbers: drawn from several
    # threads, the results are the same chunks as drawn in sequence, in some order.
    torch.openreg.manual_seed_all(6)
    sequential = [torch.rand(2000, device=device).cpu() for _ in range(16)]
    torch.openreg.manual_seed_all(6)
    results, errors = [], []

    def worker():
        try:
            for _ in range(4):
                results.append(torch.rand(2000, device=device).cpu())
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    key = lambda t: t[0].item()  # noqa: E731
    assert sorted(results, key=key) and len(results) == 16
    for r, s in zip(sorted(results, key=key), sorted(sequential, key=key)):
        assert torch.equal(r, s)


def test_threads_seeding_and_saving_while_drawing(device):
    gen = torch.openreg.default_generators[device.index]
    gen.manual_seed(1)
    saved = gen.get_state()
    expected = torch.rand(300, device=device).cpu()
    stop = threading.Event()
    errors = []

    def drawer():
        try:
            while not stop.is_set():
                torch.randn(500, device=device)
                F.dropout(torch.ones(300, device=device), 0.5, training=True)
        except Exception as e:
            errors.append(e)

    def seeder():
        try:
            for i in range(200):
                gen.manual_seed(i)
                state = gen.get_state()
                assert state.numel() == saved.numel()
                gen.set_state(saved)
                gen.clone_state()
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=drawer) for _ in range(2)] + [threading.Thread(target=seeder)]
    for t in threads[2:]:
        t.start()
    for t in threads[:2]:
        t.start()
    threads[2].join()
    stop.set()
    for t in threads[:2]:
        t.join()
    assert not errors, errors
    gen.set_state(saved)  # still a valid generator
    assert torch.equal(torch.rand(300, device=device).cpu(), expected)


def test_own_generator_per_thread_matches_sequential(device):
    seeds = [10, 20, 30, 40]
    expected = {}
    for s in seeds:
        g = torch.Generator(device=device).manual_seed(s)
        expected[s] = [torch.randn(1000, device=device, generator=g).cpu() for _ in range(5)]
    got = {}

    def worker(s):
        g = torch.Generator(device=device).manual_seed(s)
        got[s] = [torch.randn(1000, device=device, generator=g).cpu() for _ in range(5)]

    threads = [threading.Thread(target=worker, args=(s,)) for s in seeds]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for s in seeds:
        assert all(torch.equal(a, b) for a, b in zip(got[s], expected[s]))


# ---- clone_state and graph-safe state


def test_clone_state_is_independent_copy(device):
    gen = torch.Generator(device=device).manual_seed(5)
    torch.rand(3, device=device, generator=gen)
    clone = gen.clone_state()
    assert clone.device == device and clone is not gen
    from_clone = torch.rand(8, device=device, generator=clone).cpu()
    from_gen = torch.rand(8, device=device, generator=gen).cpu()
    assert torch.equal(from_clone, from_gen)  # same state, advanced separately
    clone.manual_seed(99)
    assert gen.initial_seed() == 5


def test_graphsafe_state_is_shared_not_copied(device):
    gen = torch.openreg.default_generators[device.index]
    gen.manual_seed(1)
    expected = torch.rand(6, device=device).cpu()
    gen.manual_seed(1)
    own = gen.graphsafe_get_state()
    assert own.device == device
    alt = torch.Generator(device=device).manual_seed(2)
    alt_expected = torch.rand(6, device=device, generator=alt.clone_state().manual_seed(2)).cpu()

    gen.graphsafe_set_state(alt)  # default operators now draw from alt's state
    assert torch.equal(torch.rand(6, device=device).cpu(), alt_expected)
    assert not torch.equal(alt.get_state(), torch.Generator(device=device).manual_seed(2).get_state())
    gen.graphsafe_set_state(own)  # back to the original state, which did not move meanwhile
    assert torch.equal(torch.rand(6, device=device).cpu(), expected)
    # A state object taken from a generator follows it.
    gen.manual_seed(3)
    assert gen.graphsafe_get_state().initial_seed() == 3


def test_graphsafe_set_state_rejects_other_generators(device):
    gen = torch.Generator(device=device)
    with pytest.raises(TypeError, match="expected an openreg generator"):
        gen.graphsafe_set_state(torch.Generator())
    with pytest.raises(RuntimeError, match="expected a generator of"):
        gen.graphsafe_set_state(torch.Generator(device=other(device)))
    with pytest.raises(TypeError, match="expected a Generator"):
        gen.graphsafe_set_state(3)


def test_graphsafe_run_with_rng_state(device):
    # The higher-order operator torch.compile uses to run an operator on a saved generator state.
    from torch._prims.rng_prims import graphsafe_run_with_rng_state

    gen = torch.openreg.default_generators[device.index]
    gen.manual_seed(1)
    before = gen.get_state()
    state = torch.Generator(device=device).manual_seed(4)
    out = graphsafe_run_with_rng_state(torch.ops.aten.rand.default, [4], device=device, rng_state=state)
    assert torch.equal(out.cpu(), torch.rand(4, generator=torch.Generator().manual_seed(4)))
    assert torch.equal(gen.get_state(), before)
