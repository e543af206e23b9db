"""What Kubernetes and KubeRay accept, known without a cluster: the API's naming and quantity rules, which variables
hold credentials, each KubeRay release's fields and gates, and the config's `k8s` section checked against them. Below
the config, which holds the section, and the renderer (`rayft.deploy`), which lays it onto manifests."""
