"""Analysis and control for adaptive precision (and, later, rank).

quant_reference  float64 simulations of the quantized schemes (tests, documentation)
analysis         sampled exact rows, per-head errors, cheap statistics, error predictions
controller       per-call-site precision controllers: levels per head, verification, readback
runner           which levels a policy allows here (planner), the custom op, one adaptive call
structured       structured test inputs where quantization breaks or shines
"""
