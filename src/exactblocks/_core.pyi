from typing import Annotated

import numpy
from numpy.typing import NDArray

def arithmetic_version() -> str: ...
def numeric_mode() -> str: ...
def vendor() -> str: ...
def set_num_threads(arg: int, /) -> None: ...
def get_num_threads() -> int: ...
def available_isas() -> list[str]: ...
def set_isa(arg: str, /) -> None: ...
def get_isa() -> str: ...
def elementwise(
    arg0: str,
    arg1: Annotated[
        NDArray[numpy.float32], dict(shape=(None,), order="C", device="cpu", writable=False)
    ],
    /,
) -> NDArray[numpy.float32]: ...
def first_nonfinite_spans(
    arg0: Annotated[
        NDArray[numpy.float32],
        dict(shape=(None, None, None, None), order="C", device="cpu", writable=False),
    ],
    arg1: Annotated[
        NDArray[numpy.int64], dict(shape=(None, None), order="C", device="cpu", writable=False)
    ],
    /,
) -> object: ...
def first_nonfinite_rows(
    arg0: Annotated[NDArray[numpy.float32], dict(order="C", device="cpu", writable=False)],
    arg1: Annotated[
        NDArray[numpy.int64], dict(shape=(None,), order="C", device="cpu", writable=False)
    ],
    /,
) -> object: ...
def first_nonfinite(
    arg: Annotated[NDArray[numpy.float32], dict(order="C", device="cpu", writable=False)], /
) -> int: ...
def exp_f64(arg: float, /) -> float: ...
def log_f64(arg: float, /) -> float: ...
def rope_inv_freq(
    arg0: int, arg1: float, arg2: int, arg3: float, arg4: float, arg5: float, arg6: float, /
) -> NDArray[numpy.float32]: ...
def gemm(
    a: Annotated[
        NDArray[numpy.float32], dict(shape=(None, None), order="C", device="cpu", writable=False)
    ],
    w: Annotated[
        NDArray[numpy.float32], dict(shape=(None, None), order="C", device="cpu", writable=False)
    ],
    bias: object | None = None,
    compact: bool = True,
) -> tuple: ...
def gemm_ref(
    a: Annotated[
        NDArray[numpy.float32], dict(shape=(None, None), order="C", device="cpu", writable=False)
    ],
    w: Annotated[
        NDArray[numpy.float32], dict(shape=(None, None), order="C", device="cpu", writable=False)
    ],
    bias: object | None = None,
) -> NDArray[numpy.float32]: ...
def norm(
    kind: int,
    x: Annotated[
        NDArray[numpy.float32], dict(shape=(None, None), order="C", device="cpu", writable=False)
    ],
    w: Annotated[NDArray[numpy.float32], dict(order="C", device="cpu", writable=False)],
    bias: object | None,
    eps: float,
) -> NDArray[numpy.float32]: ...
def dot_l16(
    arg0: Annotated[NDArray[numpy.float32], dict(order="C", device="cpu", writable=False)],
    arg1: Annotated[NDArray[numpy.float32], dict(order="C", device="cpu", writable=False)],
    /,
) -> float: ...
def sum_l16(
    arg: Annotated[NDArray[numpy.float32], dict(order="C", device="cpu", writable=False)], /
) -> float: ...
def reduce16_x16(
    arg: Annotated[NDArray[numpy.float32], dict(order="C", device="cpu", writable=False)], /
) -> NDArray[numpy.float32]: ...

class Workspace:
    def __init__(self) -> None: ...

class PackedLinear:
    def __init__(
        self,
        w: Annotated[
            NDArray[numpy.float32],
            dict(shape=(None, None), order="C", device="cpu", writable=False),
        ],
        bias: object | None = None,
    ) -> None: ...
    @property
    def n_out(self) -> int: ...
    @property
    def k_in(self) -> int: ...
    @property
    def format(self) -> str: ...
    @property
    def nbytes(self) -> int: ...
    def forward(
        self,
        arg: Annotated[
            NDArray[numpy.float32],
            dict(shape=(None, None), order="C", device="cpu", writable=False),
        ],
        /,
    ) -> NDArray[numpy.float32]: ...

class TransformerCore:
    def __init__(self, arg0: dict, arg1: dict, /) -> None: ...
    @property
    def weight_storage(self) -> list: ...
    def forward(
        self,
        x: Annotated[
            NDArray[numpy.float32],
            dict(shape=(None, None, None), order="C", device="cpu", writable=False),
        ],
        lengths: Annotated[
            NDArray[numpy.int64], dict(shape=(None,), order="C", device="cpu", writable=False)
        ],
        start: Annotated[
            NDArray[numpy.int64], dict(shape=(None,), order="C", device="cpu", writable=False)
        ],
        k_cache: Annotated[NDArray[numpy.float32], dict(order="C", device="cpu")],
        v_cache: Annotated[NDArray[numpy.float32], dict(order="C", device="cpu")],
        workspace: Workspace | None = None,
        check_cache: bool = False,
    ) -> object: ...

class Mamba2Core:
    def __init__(self, arg0: dict, arg1: dict, /) -> None: ...
    @property
    def weight_storage(self) -> list: ...
    def forward(
        self,
        x: Annotated[
            NDArray[numpy.float32],
            dict(shape=(None, None, None), order="C", device="cpu", writable=False),
        ],
        lengths: Annotated[
            NDArray[numpy.int64], dict(shape=(None,), order="C", device="cpu", writable=False)
        ],
        conv_window: Annotated[NDArray[numpy.float32], dict(order="C", device="cpu")],
        h: Annotated[NDArray[numpy.float32], dict(order="C", device="cpu")],
        workspace: Workspace | None = None,
    ) -> NDArray[numpy.float32]: ...
