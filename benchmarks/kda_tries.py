"""The --try switches of benchmarks/kda_kernel.py: kernel-structure experiments as module-attribute overrides.

A try is a `+`-joined list of switches (a comma list of tries on the command line, e.g.
`--try scan=32/4/2,intra=fused,wy+st32,bik=32/4`); `parse_experiment` turns one into
{(module, attribute): value} and `overridden` applies that for a block. The benchmark's `chunk` and `profile`
sections time each try against the default in the same run, after checking its forward against the default's.

Forward:
  scan=BV/warps/stages   KIMIK3_KDA_FWD=split at that scan launch
  fwd=fused | fwd=split  KIMIK3_KDA_FWD at its default scan launch
  out=BV/warps           the split forward's output kernel (default 64 / 4)
  intra | intra=MODE     KIMIK3_KDA_INTRA: split (the default), fused or tiles16
  i16 | i16=BK/warps[/1[/1]]  KIMIK3_KDA_INTRA=tiles16 at that launch (/1: phase C as its own kernel, /1/1: the
                         diagonal blocks too)
  iw=A/B/C               warps of the split intra kernels: A, the solve, W / U (default 4 / 1 / 4)
  iwarps=W               the fused intra kernel's warps
  wyc=BK/BV              phase C's K and V blocks per program (default 64 / 64)
  abk=BK                 the split phase A kernel's K block (default 64)
  solve3                 KIMIK3_KDA_SOLVE=3
  solve=MODE/warps       the split solve kernel's SOLVE mode and warps
  w32                    W stored fp32 (KIMIK3_KDA_W16=0)
  var=LETTERS            the precision variant, e.g. var=ach (checked against the default at the bf16 tests'
                         bounds)
  l2rows | l2prep        the q / k L2 norms over contiguous rows (the default) or in the prologue
                         (KIMIK3_KDA_L2_ROWS)
  l2r=BR/warps           that row kernel's rows per program and warps
  gcw=W                  the gate kernel's warps (with l2rows)
  prep1 | prep3          the prologue as one or three programs per chunk and head (KIMIK3_KDA_PREP_PARTS)
  gwy | nogwy            phase C by the Gluon kernel where it applies, or always by the Triton one
                         (KIMIK3_KDA_GLUON_WY)
  ga | noga              phase A likewise (KIMIK3_KDA_GLUON_A)
  gscan | nogscan        the split forward's state scan likewise (KIMIK3_KDA_GLUON_SCAN)
  gdh | nogdh            the backward's state-gradient scan by its Gluon kernel or the Triton one
                         (KIMIK3_KDA_GLUON_DH_SCAN)
  module.ATTR=value      any attribute of a kimik3.ops.kda module (triton_* or gluon_*), as kda_sm90_report.py's
                         --set takes it, e.g. gluon_wy.RING=1+gluon_wy.MAXNREG=128 (value None: None)
Backward:
  wy | nowy              the WY kernel split over key blocks or not (KIMIK3_KDA_WY_SPLIT=1 / 0)
  wyb=BK/BV              the WY kernel's blocks
  wydyn | wyunroll       its key-block side over a loop the compiler keeps (the default) or unrolled (WY_DYN_LOOP)
  wys=S                  that kept loop pipelined over S stages (WY_LOOP_STAGES; default 3)
  wyv | nowyv            its K-independent part's V loop kept and pipelined too (the default) or unrolled
                         (WY_V_LOOP)
  nodrv | nodq16         without the separate dRv pass / with dO S^T in tf32
  bscan=W                warps of the two backward scans
  bsc=BV/stages          the backward scans' V block and pipeline stages
  dhacc | nodhacc        the state-gradient scan's products accumulated in place (the default) or not
  dh16 | nodh16          the state gradients dh stored in the inputs' 16-bit dtype with 16-bit scans, or fp32 (the
                         default; KIMIK3_KDA_DH16)
  st32                   the backward's recomputed states stored fp32 (KIMIK3_KDA_STATES_16BIT=0)
  bwarps=W               warps of the chunk-local backward kernels
  bik=BK/warps           the intra backward's key block and warps
  brows | btiles         that kernel per row tile (the default) or per chunk (KIMIK3_KDA_BWD_INTRA)
  bis=S                  the "rows" kernel's pipeline stages (default: Triton's 3)
  gintra | nogintra      the intra backward by the Gluon kernel (gluon_bwd_intra.py; the default) or the Triton
                         "rows" kernel (triton_bwd_intra.GLUON_INTRA)
  fpb | nofpb            the pre-activations' backward inside the intra backward and the suffix-sum pass (the
                         default) or its own pass (KIMIK3_KDA_FUSE_PREACT_BWD)
  sfx=BK                 the suffix-sum pass's key columns per program (triton_bwd_intra.SUFFIX_BK; default 128, one
                         per thread)
"""

from __future__ import annotations


def _slash_ints(part: str, usage: str) -> tuple:
    """'bik=32/4' read against usage 'bik=BK/warps' -> (32, 4); fields in brackets are optional
    ('i16=BK/warps[/wy[/diag]]'); exits naming the usage on a wrong count."""
    key, fields = usage.split("=")
    required, _, optional = fields.partition("[")
    lo = len(required.split("/"))
    hi = lo + optional.count("/")
    cfg = tuple(int(x) for x in part[len(key) + 1:].split("/"))
    if not lo <= len(cfg) <= hi:
        raise SystemExit(f"--try: {usage}, got {part!r}")
    return cfg


def parse_experiment(token: str):
    """'intra+wy+scan=32/4/2' -> (token, {(module, attribute): value})."""
    import kimik3.ops.kda.triton_backward as tb
    import kimik3.ops.kda.triton_bwd_intra as tbi
    import kimik3.ops.kda.triton_forward as tf
    import kimik3.ops.kda.triton_prologue as tp
    import kimik3.ops.kda.triton_scan as ts

    overrides = {}
    for part in token.split("+"):
        if part.startswith("scan="):
            cfg = _slash_ints(part, "scan=BV/warps/stages")
            overrides[(tf, "FWD_MODE")], overrides[(tf, "SPLIT_CONFIG")] = "split", cfg
        elif part == "intra" or part.startswith("intra="):  # intra = the split kernels (the default)
            overrides[(tf, "INTRA_MODE")] = part[6:] or "split"
        elif part == "st32":
            overrides[(ts, "STATES_16BIT")] = False
        elif part.startswith("bik="):
            cfg = _slash_ints(part, "bik=BK/warps")
            overrides[(tbi, "BWD_INTRA_BK")], overrides[(tbi, "BWD_INTRA_WARPS")] = cfg
        elif part in ("brows", "btiles"):
            overrides[(tbi, "BWD_INTRA_MODE")] = part[1:]
        elif part in ("gintra", "nogintra"):  # the intra backward by the Gluon kernel or the Triton "rows" kernel
            overrides[(tbi, "GLUON_INTRA")] = part == "gintra"
        elif part.startswith("bis=") and part[4:].isdigit():  # pipeline stages of the "rows" kernel's launch
            overrides[(tbi, "ROWS_STAGES")] = int(part[4:])
        elif part.startswith("sfx="):  # the suffix-sum pass's key columns per program
            overrides[(tbi, "SUFFIX_BK")] = _slash_ints(part, "sfx=BK")[0]
        elif part in ("fpb", "nofpb"):  # the pre-activations' backward inside the intra backward, or its own pass
            overrides[(tbi, "FUSE_PREACT_BWD")] = part == "fpb"
        elif part in ("dhacc", "nodhacc"):  # the state-gradient scan's 16-bit products accumulated in place or not
            overrides[(tb, "DH_ACC_DOTS")] = part == "dhacc"
        elif part in ("dh16", "nodh16"):  # the state gradients dh stored 16-bit (with 16-bit scans) or fp32
            overrides[(tb, "DH_16BIT")] = part == "dh16"
        elif part in ("prep1", "prep3"):  # the prologue as one or three programs per (chunk, head)
            overrides[(tp, "PREP_PARTS")] = int(part[4])
        elif part in ("gwy", "nogwy"):  # phase C by the Gluon kernel (gluon_wy.py) or by the Triton one
            overrides[(tf, "GLUON_WY")] = part == "gwy"
        elif part in ("ga", "noga"):  # phase A by the Gluon kernel (gluon_phase_a.py) or by the Triton one
            overrides[(tf, "GLUON_A")] = part == "ga"
        elif part in ("gscan", "nogscan"):  # the state scan by the Gluon kernel (gluon_scan.py) or the Triton one
            overrides[(tf, "GLUON_SCAN")] = part == "gscan"
        elif part in ("gdh", "nogdh"):  # the state-gradient scan by the Gluon kernel (gluon_bwd_scan.py) or Triton
            overrides[(tb, "GLUON_DH_SCAN")] = part == "gdh"
        elif part == "w32":  # W stored fp32 (as before the seventh session)
            overrides[(tf, "W_16BIT")] = False
        elif part in ("l2rows", "l2prep"):  # the q / k L2 norms over contiguous rows, or in the PREP_PARTS prologue
            overrides[(tp, "L2_ROWS")] = part == "l2rows"
        elif part.startswith("l2r="):  # the row L2-norm kernel (rows per program, warps)
            overrides[(tp, "L2_ROWS_CONFIG")] = _slash_ints(part, "l2r=BR/warps")
        elif part.startswith("gcw=") and part[4:].isdigit():  # warps of the gate-per-column-block kernel
            overrides[(tp, "GATE_COLS_WARPS")] = int(part[4:])
        elif part.startswith("iw="):  # warps of the split intra kernels A, B (solve), C (W / U)
            overrides[(tf, "INTRA_SPLIT_WARPS")] = _slash_ints(part, "iw=A/B/C")
        elif part.startswith("wyc="):  # phase C's (K block, V block) per program
            overrides[(tf, "WY_BLOCKS")] = _slash_ints(part, "wyc=BK/BV")
        elif part.startswith("abk=") and part[4:].isdigit():  # the split phase A kernel's K block
            overrides[(tf, "A_BK")] = int(part[4:])
        elif part in ("nodrv", "nodq16"):  # the WY backward without the dRv pass / without 16-bit dO S^T
            overrides[(tb, "DRV_PASS" if part == "nodrv" else "WY_DQ16")] = False
        elif part in ("fwd=fused", "fwd=split"):
            overrides[(tf, "FWD_MODE")] = part[4:]
        elif part.startswith("out="):  # the split forward's output kernel (V block, warps)
            overrides[(tf, "OUTPUT_CONFIG")] = _slash_ints(part, "out=BV/warps")
        elif part.startswith("bsc="):
            cfg = _slash_ints(part, "bsc=BV/stages")
            overrides[(tb, "SCAN_BV")], overrides[(tb, "SCAN_STAGES")] = cfg
        elif part in ("wydyn", "wyunroll"):  # the WY backward's key-block side over a kept V loop or unrolled
            overrides[(tb, "WY_DYN_LOOP")] = part == "wydyn"
        elif part.startswith("wys=") and part[4:].isdigit():  # pipeline stages of the WY backward's kept V loop
            overrides[(tb, "WY_LOOP_STAGES")] = int(part[4:])
        elif part in ("wyv", "nowyv"):  # the WY backward's K-independent part over a kept V loop, or unrolled
            overrides[(tb, "WY_V_LOOP")] = part == "wyv"
        elif part.startswith("wyb="):
            cfg = _slash_ints(part, "wyb=BK/BV")
            overrides[(tb, "WY_BLOCKS")] = cfg
        elif part == "i16" or part.startswith("i16="):
            overrides[(tf, "INTRA_MODE")] = "tiles16"
            if part != "i16":
                overrides[(tf, "INTRA16_CONFIG")] = _slash_ints(part, "i16=BK/warps[/wy[/diag]]")
        elif part in ("wy", "nowy"):
            overrides[(tb, "WY_SPLIT_K")] = part == "wy"
        elif part.startswith("var="):  # the precision variant of the forward (and so of the backward scans)
            overrides[(tf, "DEFAULT_VARIANT")] = part[4:]
        elif part == "solve3":
            overrides[(tf, "SOLVE")] = 3
        elif part.startswith("solve="):  # solve=MODE/warps: the split solve kernel's SOLVE mode and num_warps
            cfg = _slash_ints(part, "solve=MODE/warps")
            overrides[(tf, "SOLVE")] = cfg[0]
            wa, _, wc = tf.INTRA_SPLIT_WARPS
            overrides[(tf, "INTRA_SPLIT_WARPS")] = (wa, cfg[1], wc)
        elif part.startswith("bscan=") and part[6:].isdigit():
            overrides[(tb, "SCAN_WARPS")] = int(part[6:])
        elif part.startswith("iwarps=") and part[7:].isdigit():  # warps of the fused intra kernel
            overrides[(tf, "INTRA_WARPS")] = int(part[7:])
        elif part.startswith("bwarps=") and part[7:].isdigit():
            overrides[(tb, "BWD_WARPS")] = int(part[7:])
        elif "." in part.partition("=")[0]:  # any module attribute, e.g. gluon_wy.RING=1 (kda_sm90_report's form)
            import argparse

            from kda_sm90_report import parse_override

            try:
                module, attr, value = parse_override(part)
            except argparse.ArgumentTypeError as exc:
                raise SystemExit(f"--try: {exc}") from None
            overrides[(module, attr)] = value
        else:
            raise SystemExit(f"--try: unknown switch {part!r} (scan=BV/warps/stages, intra[=MODE], "
                             "i16[=BK/W], wy, nowy, var=LETTERS, solve3, solve=MODE/W, bscan=W, bwarps=W, wyb=BK/BV, "
                             "st32, bik=BK/W, brows, btiles, bsc=BV/S, fwd=fused|split, nodrv, nodq16, w32, "
                             "prep1|prep3, dhacc|nodhacc, out=BV/W, l2rows|l2prep, l2r=BR/W, gcw=W, iw=A/B/C, "
                             "wyc=BK/BV, abk=BK, wydyn|wyunroll, wys=S, wyv|nowyv, fpb|nofpb, sfx=BK, bis=S, "
                             "iwarps=W, gintra|nogintra, gwy|nogwy, ga|noga, "
                             "gscan|nogscan, gdh|nogdh, dh16|nodh16, "
                             "module.ATTR=value)")
    return token, overrides


class overridden:
    """Apply an experiment's module-attribute overrides for a block, restoring them after."""

    def __init__(self, overrides):
        self.overrides, self.saved = overrides, {}

    def __enter__(self):
        for (mod, attr), value in self.overrides.items():
            self.saved[(mod, attr)] = getattr(mod, attr)
            setattr(mod, attr, value)

    def __exit__(self, *exc):
        for (mod, attr), value in self.saved.items():
            setattr(mod, attr, value)
