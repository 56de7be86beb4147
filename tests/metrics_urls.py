"""URLs for the metrics view's test: the view where a project would route it."""

from django.urls import path

from djlocks.metrics import metrics_view

urlpatterns = [path("metrics/", metrics_view)]
