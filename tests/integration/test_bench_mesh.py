"""bench.hub_scale's weight-group part, small: a lazy gloo group of 5 ranks (a binomial tree two levels deep)
spread over processes, each rank receiving the weights rank 0 sends (Buckets.send, receive_buckets) and checking
them bit for bit. (The connected-every-pair form is the one the other weight tests use.)"""

from bench.hub_scale import mesh


def test_every_rank_of_a_lazy_group_gets_the_weights_exactly():
    row = mesh(5, lazy=True)
    assert row["result"] == "formed", row
    assert row["exact"] == 4 and row["weights_s"] > 0
