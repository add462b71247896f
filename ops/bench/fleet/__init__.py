"""`kvstash bench fleet` (and the retired `bench load`): many users through a balancer, under load and churn."""
