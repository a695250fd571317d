"""Architecture name -> model class, imported only when first asked for.

Adding an architecture is one line here and one file in models/.
"""

from __future__ import annotations

import importlib

from xlserve.models.interface import LanguageModel

ARCHITECTURES: dict[str, str] = {
    "transformer-xl": "xlserve.models.transformer_xl:TransformerXL",
    "infinity-former": "xlserve.models.infinity_former:InfinityFormer",
    "vanilla": "xlserve.models.vanilla:VanillaTransformer",
    "xlnet": "xlserve.models.xlnet:XLNet",
    "logsparse": "xlserve.models.logsparse:LogSparseTransformer",
    "adaptive-span": "xlserve.models.adaptive_span:AdaptiveSpan",
    "longformer": "xlserve.models.longformer:Longformer",
    "performer": "xlserve.models.performer:Performer",
    "linformer": "xlserve.models.linformer:Linformer",
    "lite-transformer": "xlserve.models.lite_transformer:LiteTransformer",
    "conformer": "xlserve.models.conformer:Conformer",
    "reformer": "xlserve.models.reformer:Reformer",
    "mamba": "xlserve.models.mamba:Mamba",
    "mamba2": "xlserve.models.mamba2:Mamba2",
    "rwkv": "xlserve.models.rwkv:Rwkv",
}


def model_class(architecture: str) -> type[LanguageModel]:
    try:
        target = ARCHITECTURES[architecture]
    except KeyError:
        known = ", ".join(sorted(ARCHITECTURES))
        raise ValueError(f"unknown architecture '{architecture}' (known: {known})") from None
    module_name, class_name = target.split(":")
    return getattr(importlib.import_module(module_name), class_name)


def build_model(architecture: str, config: dict) -> LanguageModel:
    cls = model_class(architecture)
    model = cls(cls.config_class.from_dict(config))
    return model
