"""The four methods on one quantizer: RTN, SmoothQuant†, QuaRot†, QuantMLA.

`registry` names them (light), `prepare` loads an artifact or calibrates, `base` fuses
(`apply_method`) and saves artifacts; one module per method."""
