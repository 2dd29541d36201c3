"""`distill publish`: versioned draft releases with a model card carrying measured results."""
