"""Triton 3.6's CPU interpreter (TRITON_INTERPRET=1) under numpy >= 2.4: the interpreter turns a
kernel's scalars (1-element arrays there) into loop bounds with int(array), which numpy >= 2.4
refuses, so the kernels' `range(lo, hi)` over runtime bounds needs the element itself. `apply()`
patches that one interpreter function and leaves the rest of it as it is. Used by the interpreted
kernel checks and the GPU check's CPU dry run; never by inferd itself."""

from __future__ import annotations


def apply() -> None:
    from triton.runtime import interpreter

    if getattr(interpreter, "_inferd_numpy24_patch", False):
        return
    patch_lang_tensor = interpreter._patch_lang_tensor

    def patch_lang_tensor_numpy24(tensor, scope) -> None:
        patch_lang_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch_lang_tensor_numpy24
    interpreter._inferd_numpy24_patch = True
