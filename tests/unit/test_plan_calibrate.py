"""--calibrate measures this machine (matmul, gloo all-reduce and p2p with 2 processes) into a profile file
that --device reads back."""
from pipetrain.plan.calibrate import calibrate, save_profile
from pipetrain.plan.devices import load_profile


def test_calibrated_profile_is_positive_and_round_trips(tmp_path):
    profile = calibrate(repeats=2)
    assert min(profile.fp32_flops, profile.bf16_flops, profile.intra_bw, profile.memory_bytes) > 0
    assert profile.intra_latency >= 0 and profile.inter_bw == profile.intra_bw
    path = tmp_path / "me.json"
    save_profile(profile, str(path))
    assert load_profile(str(path)) == profile
