"""`distill publish`: versioned draft releases with a model card carrying measured results."""

from distill.publish.release import verify_release

__all__ = ["verify_release"]
