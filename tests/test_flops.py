"""FLOPs per token from the model shape, against a count done by hand for the debug model."""

from test_config import compose

from hsdp_runner.models.llama import Llama, count_params, flops_per_token


def test_flops_per_token_matches_hand_count_for_debug_model():
    model = compose(["model=llama3_debug"]).model
    # dim 256, 6 layers, 16 heads (head_dim 16), 8 kv heads, ffn 768, vocab 2048, seq 512.
    wq, wo = 256 * 256, 256 * 256
    wk = wv = 256 * (8 * 16)
    ffn = 3 * 256 * 768
    per_layer = wq + wk + wv + wo + ffn  # 65536*2 + 32768*2 + 589824 = 786432
    output = 2048 * 256  # 524288
    matmul = 6 * per_layer + output  # 5242880
    attention = 12 * 6 * 256 * 512  # 9437184
    assert per_layer == 786_432 and matmul == 5_242_880
    assert flops_per_token(model) == 6 * matmul + attention == 40_894_464


def test_param_count_matches_the_built_model():
    model_cfg = compose(["model=llama3_debug"]).model
    built = sum(p.numel() for p in Llama(model_cfg).parameters())
    assert count_params(model_cfg)["total"] == built
