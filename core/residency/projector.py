"""A vision projector's weights, released and restored with the model's (issue 41, item 5).

libmtmd's clip context has its own ggml context and weight buffer, which llama.cpp's model knows
nothing of: the model's warm-up graph never shows them. They are found the way the model's are
(residency/discovery.py), in the clip context's own graph: ``mtmd_context_params`` takes an eval
callback for the clip scheduler, and libmtmd's warm-up encode at init (a blank image of the
projector's size) runs the whole vision tower through it. :class:`ProjectorWatch` is that
callback; once the warm-up is over it only answers "no" (an encode then costs one Python call per
graph node: about 1 ms for a 27-layer tower; a context's callback cannot be taken out).

The weights found make a second in-place plan (``InPlace`` with this discovery: one part, the host
shadow read from the projector's GGUF, the same buffer swap), which ``Residency`` releases with the
model's weights and restores with them (:meth:`.residency.Residency.attach_projector`). Where the
plan cannot be made (a weight the graph did not show, a buffer type not checked) the projector
stays on the device and ``Residency.projector_note`` says why.
"""

from __future__ import annotations

from typing import Any

import llama_cpp

from . import _ggml
from .discovery import Discovery, complete_from_tensor_lists
from .unsupported import InPlaceUnsupportedError


class ProjectorWatch:
    """The eval callback to give a clip context (``mtmd_context_params.cb_eval``) so that its
    warm-up encode shows its weight tensors. Keep it referenced as long as the context lives."""

    def __init__(self) -> None:
        self.note = ""  # why the weights could not be watched ("": they could)
        layout = _ggml.TensorLayout()
        try:
            _ggml.probe_tensor_layout(layout)
        except _ggml.LayoutMismatchError as exc:
            self.note = str(exc)
        self.discovery = Discovery(layout)
        self._watching = not self.note
        self.callback: Any = llama_cpp.ggml_backend_sched_eval_callback(self._eval)

    def _eval(self, tensor: int | None, ask: bool, user: int | None) -> bool:
        if self._watching:
            return self.discovery.observe(tensor, ask, user)
        return False

    def stop(self) -> Discovery:
        """The warm-up is over: stop watching, and return the weights it showed with the ones the
        clip context's tensor list holds beside them. Raises InPlaceUnsupportedError when none
        were seen (a projector without warm-up?)."""
        self._watching = False
        if self.note:
            raise InPlaceUnsupportedError(self.note)
        if not self.discovery.weights:
            raise InPlaceUnsupportedError("the projector's warm-up encode showed no weight tensors")
        complete_from_tensor_lists(self.discovery)
        return self.discovery
