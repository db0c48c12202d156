"""Model families, one file each; importing this package registers them with timm.

After ``import trainers.models``, ``timm.create_model("ls_convit_nano", ...)`` works.
"""
from .ls_convit import LocalityConViT
from .ls_refiner import LocalityRefinerViT
from .ls_gmm import LocalityGMMViT
from .ls_tcnn import TransformedResNet

__all__ = ["LocalityConViT", "LocalityRefinerViT", "LocalityGMMViT", "TransformedResNet"]
