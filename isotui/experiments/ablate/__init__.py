"""ablate: remove a direction at a site and measure what the model loses (issue 39).

A first pass estimates each site's directions from its kept tokens (as every metric); a second
pass runs each batch unedited and once per (site, removal), and once more along random
directions of the same size (the yardstick), on the same inputs: the model's own loss, the
change of its final states, and every layer's avg_cos and drift after the edit.
"""
