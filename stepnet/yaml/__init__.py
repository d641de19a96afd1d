"""Networks defined in YAML files: ``stepnet.load_yaml(path)``.

The format is documented in docs/yaml.md. A loaded :class:`Model` is built
with the step-net DSL, so its IR is the one the same network written in
Python gives.
"""

from .document import format_key
from .model import load_yaml
from .network import InputSpec, Model

__all__ = ["InputSpec", "Model", "format_key", "load_yaml"]
