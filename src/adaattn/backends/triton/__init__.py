"""Our exact Triton attention's glue, one idea a file (the kernels are in adaattn/kernels/):

    common     the small shared helpers; the one module that code outside backends/ imports
    launch     the frozen launch description and the facts that choose a variant
    layout     where rows and outputs live: shapes, strides, packed tails
    configs    the candidate config tables and the shared-memory fit
    tuner      the config tuner (timed once per shape class)
    forward    the forward launchers (pointer / TMA, warp-specialised, Gluon)
    backward   the backward launchers (general, warp-specialised, Gluon)
    ops        torch custom ops and autograd over the launchers
    runner     the triton.ws / triton.tma / triton.ptr runners and triton_attention()
    merge      the log-sum-exp merge of partial results (the ring's blocks)

This file imports nothing: importing a submodule imports only what it needs.
"""
