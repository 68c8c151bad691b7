"""What runs a model on a device, over the platform object (:mod:`deepinfer.runtime.platform`: the device, streams,
events, graphs and host copies an accelerator offers; each backend's folder implements it): non-blocking host ->
device copies (``host_copy``), the model-agnostic graph capture of decode steps (``decode_graphs``) and of prefill /
mixed steps by pieces (``piecewise_graphs``). No module outside a backend's folder names a vendor's device API."""
