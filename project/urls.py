from django.contrib import admin
from django.urls import path

from project.demo.views import render_pdf

urlpatterns = [
    path("admin/", admin.site.urls),
    path("render/", render_pdf, name="render-pdf"),
]
