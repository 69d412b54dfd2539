"""KV codecs: fewer bytes for a page on its way down a tier, and back.

Each codec is one module that registers itself by name (base.register):
`none` and `lossless` (lossless.py: bit-exact, byte planes + zstd), `fp8`
and `k16v8` (scaled.py: scaled float8 e4m3), `int8` and `int4`
(kivi.py: asymmetric integers, K per channel and V per token). A lossy
codec measures what it changed at encode (base.code: each page's relative
L2 error and largest absolute error). See base.py for what a page is to a
codec and where they run."""

from tierd.codecs import lossless  # noqa: F401 - registers none and lossless
from tierd.codecs.base import (Codec, Coded, PageShape, as_is, code, error, for_spec, get, lossless_shape, names,
                               page_shape, register, register_later)

# The lossy codecs do their arithmetic in torch: their modules load when one is first asked for.
for _name, _module in (("fp8", "scaled"), ("k16v8", "scaled"), ("int8", "kivi"), ("int4", "kivi")):
    register_later(_name, f"tierd.codecs.{_module}")

__all__ = ["Codec", "Coded", "PageShape", "as_is", "code", "error", "for_spec", "get", "lossless_shape", "names",
           "page_shape", "register", "register_later"]
