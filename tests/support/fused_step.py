"""The fused decode step forced on a loaded model, for the tests that compare it with the Python forward."""
from llmd.runtime.models.fused_decode import FusedDecode
from llmd.runtime.models.layers import Linear, MatvecPlan


def force_fused(model) -> FusedDecode:
    """Every layer product on llmd's float32 kernel, without oneDNN's copy (as the plans already store
    them), then the fused form."""
    for m in model.layers.modules():
        if type(m) is Linear:
            m.apply_plan(MatvecPlan("blocked", 1, 16, packed=False))
    model.fused_decode = FusedDecode.build(model)
    assert model.fused_decode is not None
    return model.fused_decode
