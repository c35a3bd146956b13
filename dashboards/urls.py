"""The dashboard's routes (DESIGN.md's stable URLs). A new page: its view, a route here, an entry in nav.PAGES."""
from django.contrib.auth import views as auth_views
from django.urls import path

from . import views

urlpatterns = [
    path("", views.overview, name="overview"),
    path("requests/", views.requests_explorer, name="requests"),
    path("traces/<str:trace_id>", views.trace_detail, name="trace"),
    path("accounts/login/", auth_views.LoginView.as_view(template_name="dashboards/login.html",
                                                         redirect_authenticated_user=True), name="login"),
    path("accounts/logout/", auth_views.LogoutView.as_view(), name="logout"),
]
