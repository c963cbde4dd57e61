"""Load testing of the services stack: a Locust locustfile and the SLA / Pareto sweep."""
