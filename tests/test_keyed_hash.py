"""One counter-based hash serves RoE's per-layer noise, evaluation's per-request noise and the
calibration sample: its draws are pinned to the values each module drew before they shared it."""

from __future__ import annotations

import torch

from moectl.ensemble import noise
from moectl.eval import request_noise
from moectl.routing import keyed_hash
from moectl.subsets import stats


def test_mix_int_is_mix_on_one_value():
    for x in (0, 1, 0x9E3779B9, 2**32 - 1, 2**40 + 7, -5):
        assert keyed_hash.mix_int(x) == int(keyed_hash.mix(torch.tensor(x & keyed_hash.M32)))


def test_roe_noise_draws_are_unchanged():
    keys = noise.layer_keys(7, range(3))
    assert keys == [4095758840, 2972780909, 3135082065]
    g = noise.layer_gumbel(noise.layer_keys(7, [1])[0], torch.tensor([[0], [3]]), torch.tensor([[0, 5]]), 4)
    expected = [
        -1.0863006114959717, 0.07535141706466675, -0.1870499700307846, 3.3095345497131348,
        0.8918794393539429, 1.110355257987976, 0.9552007913589478, 1.853111982345581,
        0.37348222732543945, -0.9996837377548218, 1.1433473825454712, 0.343534380197525,
        0.607780933380127, 1.6949495077133179, -1.231029748916626, -0.5810598731040955,
    ]  # fmt: skip
    # the integer hash (keys above) is exact everywhere; -log(-log(u)) goes through the CPU's vector
    # log, whose last bits differ between instruction sets (measured: two Xeon machines), so a few ulps
    torch.testing.assert_close(g.flatten(), torch.tensor(expected, dtype=torch.float32), rtol=4e-7, atol=4e-7)


def test_request_noise_draws_are_unchanged():
    salt = request_noise.layer_salt(1234, 2)
    assert salt == 3103444667
    keys = ["0123456789abcdef0123456789abcdef", "ffffffffffffffffffffffffffffffff"]
    codes = request_noise.request_codes(keys, salt=5)
    assert codes.tolist() == [2359104941, 1660730884]
    u = request_noise.hashed_uniform(codes, torch.tensor([[0, 1], [2, 3]]), salt, 3)
    expected = [
        0.23709943890571594, 0.14782491326332092, 0.7982590198516846, 0.9238930940628052,
        0.4688285291194916, 0.903479814529419, 0.6469407081604004, 0.8445687294006348,
        0.9252827167510986, 0.9546809196472168, 0.6732888221740723, 0.46454766392707825,
    ]  # fmt: skip
    assert torch.equal(u.flatten(), torch.tensor(expected, dtype=torch.float32))
    assert bool(((u > 0) & (u < 1)).all())


def test_calibration_sample_hash_is_unchanged():
    assert stats._hash(torch.arange(4), 3).tolist() == [3373494168, 514453568, 1510418313, 3255750168]
