"""The Hopper (sm_90) Gluon kernels of KDA, warp-specialised with TMA rings: one module per pipeline stage they take
over from the Triton kernels (``dispatch.py`` says where each runs), their shared runtime in ``runtime.py``.

    wy        forward stage 4: W, U and the scan operands
    scan      forward stage 5: the training forward's state scan over 64-token chunks, with the output
    scan16    a forward alone's state scan over 16-token tiles, with the output (``prep16.py`` writes its operands)
    bwd_scan  backward stage 1: the state-gradient scan, with dRv = T^T dv_new
    bwd_wy    backward stage 2: the WY backward
    bwd_intra backward stage 3: the gradients through Aqk and A

Importing this package needs a Triton with Gluon (``triton.experimental.gluon``); ``dispatch.gluon_available`` asks.
"""
